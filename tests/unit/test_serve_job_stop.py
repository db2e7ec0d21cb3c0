"""serve.supervise.job_stop_warning: `eaglenest serve` as a Ray job says when `ray job stop` would cut its drain."""

from __future__ import annotations

import pytest

from eaglenest.ray_private import JOB_DRIVER_ENV, JOB_STOP_WAIT_ENV
from eaglenest.serve.supervise import job_stop_warning

JOB = {JOB_DRIVER_ENV: "{}"}


def test_a_job_with_rays_default_grace_is_warned_with_the_fix():
    msg = job_stop_warning(30.0, JOB)
    assert msg is not None and "3 s" in msg and f'"{JOB_STOP_WAIT_ENV}": "40"' in msg  # drain + 10 s, an integer


@pytest.mark.parametrize("env,drain", [({}, 30.0), ({**JOB, JOB_STOP_WAIT_ENV: "40"}, 30.0),
                                       ({**JOB, JOB_STOP_WAIT_ENV: "12"}, 2.0)])
def test_no_warning_outside_a_job_or_with_enough_grace(env, drain):
    assert job_stop_warning(drain, env) is None


def test_a_grace_ray_cannot_read_counts_as_its_default():
    assert "3 s" in job_stop_warning(30.0, {**JOB, JOB_STOP_WAIT_ENV: "40.5"})
