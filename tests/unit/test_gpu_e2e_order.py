"""The GPU script's step order: at Kimi's widths the first device call (whose carry has no room for Ray's bundle) runs
the steps after the stand-in that need no Ray, SGLang's offline reference among them, so the run fits in three calls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_e2e.py"


def _order(arch: str, *args: str, **env_extra: str) -> list[str]:
    env = {**os.environ, "E2E_ARCH": arch, **env_extra}
    out = subprocess.run([sys.executable, str(SCRIPT), "order", *args], env=env, capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return out.stdout.split()


def test_deepseek_runs_sglang_s_yardstick_before_ray_and_every_other_step_after() -> None:
    before, after = _order("deepseek_v3", "before-ray"), _order("deepseek_v3")
    assert before == ["jit_wait", "configs", "offline_ref"]
    assert after[:2] == ["ray_start", "regen"] and not set(before) & set(after)
    assert {"train", "preflight", "bench", "serve"} <= set(after)


def test_deepseek_runs_the_eagle_check_and_the_parity_run_beside_serve_not_after_it() -> None:
    """The ninth attempt's run was ~300 s longer than a session; the two checks after serve were ~140 s of it. They
    are side steps now (started with serve, in a process of their own), unless E2E_SIDE_WITH_SERVE=0."""
    after = _order("deepseek_v3")
    assert "eagle_forced" not in after and "capture_parity" not in after
    serial = _order("deepseek_v3", E2E_SIDE_WITH_SERVE="0")
    assert serial.index("serve") < serial.index("eagle_forced") < serial.index("capture_parity")
    assert "eagle_forced" in _order("llama")  # the Llama run keeps its order


def test_llama_keeps_one_list() -> None:
    assert _order("llama", "before-ray") == []
    assert _order("llama")[0] == "configs" and "offline_ref" in _order("llama")


BLOCK_RAY = """
import sys
class NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("ray is not on this call's machine yet: " + name)
sys.meta_path.insert(0, NoRay())
sys.path.insert(0, "benchmarks")
import gpu_e2e  # noqa: F401
from eaglenest.config import load_config  # noqa: F401
from eaglenest.contracts.target import TargetSpec  # noqa: F401
from eaglenest.engines.base import render_chat_ids  # noqa: F401
from eaglenest.engines.sglang.args import engine_kwargs  # noqa: F401
from eaglenest.engines.sglang.engine import sglang_symbol  # noqa: F401
from eaglenest.engines.standin import chat_of  # noqa: F401
print("imported without ray")
"""


def test_the_steps_before_ray_import_nothing_of_ray() -> None:
    env = {**os.environ, "E2E_ARCH": "deepseek_v3"}
    out = subprocess.run([sys.executable, "-c", BLOCK_RAY], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "imported without ray" in out.stdout


def test_side_steps_share_the_card_with_serve_only_where_two_engines_fit() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_e2e", SCRIPT)
    gpu_e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_e2e)
    gib = 2**30
    h200, h100 = int(139.8 * gib), int(79.2 * gib)
    kimi, kimi_drafter, small, small_drafter = int(44.3e9), int(2.4e9), int(13.3e9), int(1.0e9)
    assert gpu_e2e.side_steps_fit(h200, kimi, kimi_drafter)
    assert not gpu_e2e.side_steps_fit(h100, kimi, kimi_drafter)  # there the side steps run after serve
    assert gpu_e2e.side_steps_fit(h100, small, small_drafter)  # the small preset's run of 2026-12-06


def test_steps_skip_leaves_named_steps_out_and_refuses_a_name_that_is_no_step() -> None:
    """A rehearsal of the tune steps skips the bench and serve; a typo must not run the whole loop instead."""
    order = _order("llama", E2E_TUNE="1", E2E_STEPS_SKIP="offline_ref,bench,serve")
    assert "bench" not in order and "serve" not in order and "offline_ref" not in order
    assert order.index("train") < order.index("tune") < order.index("ramp")
    env = {**os.environ, "E2E_ARCH": "llama", "E2E_STEPS_SKIP": "bnech"}
    out = subprocess.run([sys.executable, str(SCRIPT), "order"], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0 and "bnech" in out.stderr and "bench" in out.stderr


def test_the_runner_stops_at_a_failed_stand_in_instead_of_running_every_step_on_nothing(tmp_path: Path) -> None:
    """On an 80 GB card the stand-in's pre-training once ran out of memory and the runner went on through regen,
    train, bench and serve on no target (~480 s of device time, every step an error). A failed stand-in now ends the
    run at once, with both "done" marks written so the device calls waiting on them return."""
    work = tmp_path / "work"
    env = {**os.environ, "E2E_WORK_CPU": str(work), "E2E_SHAREGPT": str(tmp_path / "no-such-dump.json")}
    res = subprocess.run(["bash", "benchmarks/gpu_e2e.sh", "--cpu"], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "the runner stops here" in res.stdout
    assert (work / "phaseA.done").is_file() and (work / "all.done").is_file()
    steps = work / "results" / "steps"
    assert json.loads((steps / "standin.json").read_text())["status"] == "error"
    assert sorted(p.stem for p in steps.glob("*.json")) == ["jit_wait", "jit_warm", "standin"]
    assert "standin: error" in (work / "results" / "summary.txt").read_text()
