"""Contract tests against the real sglang 0.5.14 package on a CPU box (run by .ci/sglang_contract.sh in its own venv).

They feed sglang's own ServerArgs / ModelConfig / model code with eaglenest's launch kwargs and drafter folders, so a
mismatch between what eaglenest believes and what SGLang does fails here, not on a GPU cluster days later.
In the main venv (no sglang) the module is skipped: it only runs where the contract script puts it.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

if os.environ.get("EAGLENEST_SGLANG_CONTRACT") != "1":
    pytest.skip("sglang contract tests run inside .ci/sglang_contract.sh's venv", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: sglang_shims
import sglang_shims  # noqa: E402

sglang_shims.install()

from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang_shims.fixtures import export_eagle3_drafter, write_eagle3_drafter, write_target  # noqa: E402

from eaglenest.config import SGLangEngineConfig, SpecConfig  # noqa: E402
from eaglenest.contracts.layers import default_aux_layer_ids, engine_captured_layers, engine_layer_ids  # noqa: E402
from eaglenest.drafters.preflight import SpeculativeConfigError  # noqa: E402
from eaglenest.engines.sglang.args import SGLANG_VERSION, capture_server_kwargs, engine_kwargs  # noqa: E402
from eaglenest.engines.sglang.engine import SGLANG_INTERNALS, installed_sglang_version, require_sglang  # noqa: E402
from eaglenest.engines.sglang.spec import speculative_engine_kwargs  # noqa: E402
from eaglenest.targets import DEEPSEEK_V3, KIMI_K25, arch_for  # noqa: E402

CPU_ONLY = {"device": "cuda", "skip_tokenizer_init": True}  # §G: explicit device; config-only folders, no tokenizer


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    target = write_target(tmp_path / "target")
    drafter = export_eagle3_drafter(tmp_path / "drafter", physical_ids=default_aux_layer_ids(8))
    return target, drafter


def test_installed_version_is_the_pin() -> None:
    assert installed_sglang_version() == SGLANG_VERSION
    require_sglang()


@pytest.mark.parametrize("shape", [(3, 1, 4), (5, 4, 8), (2, 1, 3)])
def test_serverargs_from_our_speculative_kwargs(folders: tuple[Path, Path], shape: tuple[int, int, int]) -> None:
    target, drafter = folders
    steps, topk, draft = shape
    kw, launch = speculative_engine_kwargs(str(target), SGLangEngineConfig(), drafter,
                                           SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=draft))
    sa = ServerArgs(**kw, **CPU_ONLY)
    assert sa.speculative_algorithm == "EAGLE3" == launch.algorithm
    assert (sa.speculative_num_steps, sa.speculative_eagle_topk, sa.speculative_num_draft_tokens) == shape
    assert Path(sa.speculative_draft_model_path).resolve() == drafter.resolve()
    assert sa.attention_backend == "triton" and sa.sampling_backend == "pytorch" and sa.grammar_backend == "none"


def test_a_drafter_flashinfer_cannot_run_drafts_on_triton_in_sglangs_own_args(tmp_path: Path) -> None:
    """The Llama-shaped head at Kimi's widths has 112-wide heads, which flashinfer lacks: the target keeps flashinfer
    (its MLA verify pass), the draft gets SGLang's own speculative_draft_attention_backend = triton."""
    target = write_target(tmp_path / "t", hidden=448, heads=4)
    drafter = export_eagle3_drafter(tmp_path / "d", physical_ids=default_aux_layer_ids(8), hidden=448, heads=4)
    kw, _ = speculative_engine_kwargs(str(target), SGLangEngineConfig(attention_backend="flashinfer"), drafter,
                                      SpecConfig())
    sa = ServerArgs(**kw, **CPU_ONLY)
    assert sa.attention_backend == "flashinfer" and sa.speculative_draft_attention_backend == "triton"


def test_the_launch_phase_takes_our_sigquit_handler(folders: tuple[Path, Path]) -> None:
    """eaglenest.engines.sglang.launch_failure relies on ServerArgs taking ``custom_sigquit_handler`` and on the
    engine's launch registering it in place of the handler that ends the process tree, and on a dead scheduler making
    the start raise (``_wait_for_scheduler_ready``)."""
    from eaglenest.engines.sglang.launch_failure import launch_failure_logged

    target, _ = folders
    sa = ServerArgs(**engine_kwargs(str(target), SGLangEngineConfig()), custom_sigquit_handler=launch_failure_logged,
                    **CPU_ONLY)
    assert sa.custom_sigquit_handler is launch_failure_logged
    src = " ".join(Path(importlib.util.find_spec("sglang.srt.entrypoints.engine").origin).read_text().split())
    assert "if server_args.custom_sigquit_handler is None:" in src
    assert "signal.signal(signal.SIGQUIT, server_args.custom_sigquit_handler)" in src
    assert "raise _scheduler_died_error(" in src


def test_generation_and_capture_kwargs(folders: tuple[Path, Path]) -> None:
    target, _ = folders
    gen = ServerArgs(**engine_kwargs(str(target), SGLangEngineConfig()), **CPU_ONLY)
    assert gen.disable_radix_cache is False and gen.speculative_algorithm is None
    cap = ServerArgs(**capture_server_kwargs(str(target), SGLangEngineConfig()), device="cuda")
    assert cap.disable_radix_cache is True
    assert cap.chunked_prefill_size is None or cap.chunked_prefill_size <= 0
    assert cap.disable_cuda_graph is True and cap.tp_size == 1


def test_exported_drafter_config_through_sglang_modelconfig(folders: tuple[Path, Path]) -> None:
    target, drafter = folders
    kw, _ = speculative_engine_kwargs(str(target), SGLangEngineConfig(), drafter, SpecConfig())
    sa = ServerArgs(**kw, **CPU_ONLY)
    target_mc = ModelConfig.from_server_args(sa)
    draft_mc = ModelConfig.from_server_args(sa, model_path=str(drafter), is_draft_model=True)
    hf = draft_mc.hf_config
    assert hf.architectures == ["LlamaForCausalLMEagle3"]
    assert hf.num_hidden_layers == 1
    assert hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == engine_layer_ids(
        default_aux_layer_ids(8), engine="sglang", architecture="LlamaForCausalLM", num_layers=8)
    assert hf.max_position_embeddings >= target_mc.context_len
    assert not hasattr(hf, "num_nextn_predict_layers")
    assert getattr(hf, "draft_vocab_size", None) == 256


def test_sglang_takes_aux_ids_only_from_eagle_config(tmp_path: Path) -> None:
    """The default export carries vLLM's physical ids at the top level next to SGLang's ids in eagle_config
    (drafters.eagle3.engine_ids). SGLang's ModelConfig keeps both, and the runner that picks the layers to capture
    reads only eagle_config's (and the speculative modules size fc from eagle_config's list), so the top-level key
    cannot reach SGLang's capture."""
    import re

    from sglang.srt.model_executor import model_runner

    from eaglenest.drafter.export import export_drafter
    from eaglenest.drafters.eagle3.engine_ids import sglang_reads
    from eaglenest.drafters.eagle3.model import Eagle3Drafter, load_drafter

    target = write_target(tmp_path / "target")
    one = load_drafter(export_eagle3_drafter(tmp_path / "sg", physical_ids=[3, 4, 6]), device="cpu")
    drafter = export_drafter(Eagle3Drafter(one.config), tmp_path / "both", fmt="both")
    kw, _ = speculative_engine_kwargs(str(target), SGLangEngineConfig(), drafter, SpecConfig())
    hf = ModelConfig.from_server_args(ServerArgs(**kw, **CPU_ONLY), model_path=str(drafter),
                                      is_draft_model=True).hf_config
    assert hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5] == sglang_reads(hf.to_dict())[0]
    assert hf.eagle_aux_hidden_state_layer_ids == [3, 4, 6]  # vLLM's key, carried along and not read
    src = inspect.getsource(model_runner)
    assert re.search(r'eagle_config\[\s*"eagle_aux_hidden_state_layer_ids"\s*\]', src)
    for mod in ("sglang.srt.model_executor.model_runner", "sglang.srt.speculative.eagle_info",
                "sglang.srt.speculative.eagle_utils", "sglang.srt.models.llama_eagle3"):
        text = Path(importlib.util.find_spec(mod).origin).read_text()
        assert not re.search(r'getattr\(\s*[\w.]*config\s*,\s*"eagle_aux_hidden_state_layer_ids"', text), mod


def test_short_drafter_context_refused_by_us_and_by_sglang(tmp_path: Path) -> None:
    target = write_target(tmp_path / "target", context=2048)
    drafter = write_eagle3_drafter(tmp_path / "drafter", physical_ids=default_aux_layer_ids(8), context=1024)
    with pytest.raises(SpeculativeConfigError, match="max_position_embeddings 1024"):
        speculative_engine_kwargs(str(target), SGLangEngineConfig(), drafter, SpecConfig())
    sa = ServerArgs(model_path=str(target), context_length=2048, **CPU_ONLY)
    with pytest.raises(ValueError):  # SGLang agrees, but only once the draft worker starts
        ModelConfig.from_server_args(sa, model_path=str(drafter), is_draft_model=True)


def test_eagle_with_an_eagle3_drafter_refused_by_us_but_accepted_by_sglang(folders: tuple[Path, Path]) -> None:
    target, drafter = folders
    with pytest.raises(SpeculativeConfigError, match="EAGLE-3 checkpoint"):
        speculative_engine_kwargs(str(target), SGLangEngineConfig(), drafter, SpecConfig(algorithm="EAGLE"))
    # The upstream gap (sglang PR #21272, closed unmerged): sglang 0.5.14 takes this silently. If this ever raises,
    # upstream closed the gap and our refusal becomes a second line of defence.
    sa = ServerArgs(model_path=str(target), speculative_algorithm="EAGLE", speculative_draft_model_path=str(drafter),
                    speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4, **CPU_ONLY)
    assert sa.speculative_algorithm == "EAGLE"


def test_sglang_fails_partial_spec_args_with_a_bare_assert(folders: tuple[Path, Path]) -> None:
    """Why we always pass all three: sglang fails partial shapes without a message (and ours cannot build one)."""
    target, drafter = folders
    with pytest.raises(AssertionError):
        ServerArgs(model_path=str(target), speculative_algorithm="EAGLE3", speculative_draft_model_path=str(drafter),
                   speculative_eagle_topk=1, **CPU_ONLY)


def _fake_model(num_layers: int) -> SimpleNamespace:
    return SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True),
                           config=SimpleNamespace(num_hidden_layers=num_layers),
                           model=SimpleNamespace(layers_to_capture=[]), capture_aux_hidden_states=False)


ID_CASES = [None, [1, 3, 4], [2, 4, 5], [0, 3, 5], [1, 29, 57], [2, 30, 58], [3, 10, 20]]


@pytest.mark.parametrize("ids", ID_CASES)
@pytest.mark.parametrize(("module", "cls", "arch"), [
    ("sglang.srt.models.llama", "LlamaForCausalLM", "LlamaForCausalLM"),
    ("sglang.srt.models.deepseek_v2", "DeepseekV3ForCausalLM", "DeepseekV3ForCausalLM"),
])
def test_layer_rule_matches_sglang_model_code(module: str, cls: str, arch: str, ids: list[int] | None) -> None:
    """eaglenest.contracts.layers.engine_captured_layers == what the installed sglang model's own hook sets."""
    import importlib

    model_cls = getattr(importlib.import_module(module), cls)
    n = 61
    fake = _fake_model(n)
    model_cls.set_eagle3_layers_to_capture(fake, ids)
    assert fake.capture_aux_hidden_states is True
    ours = engine_captured_layers(ids, engine="sglang", architecture=arch, num_layers=n)
    assert list(fake.model.layers_to_capture) == ours
    if ids is not None and fake.model.layers_to_capture:  # and the export's ids for those layers round-trip
        captured = list(fake.model.layers_to_capture)
        again = _fake_model(n)
        model_cls.set_eagle3_layers_to_capture(again, engine_layer_ids(captured, engine="sglang", architecture=arch,
                                                                       num_layers=n))
        assert list(again.model.layers_to_capture) == captured


def test_first_id_rule_table_matches_sglang_sources() -> None:
    """Every architecture we treat with the DeepSeek/Kimi rule really carries that code in sglang 0.5.14."""
    import importlib

    import sglang.srt.models.deepseek_v2 as ds

    # the rule itself, run: DeepseekV2's own hook shifts the ids only when the first is 1 (Llama's always shifts)
    for ids, shifted in (([1, 3, 4], True), ([2, 30, 58], False), ([0, 3, 5], False)):
        fake = _fake_model(61)
        ds.DeepseekV2ForCausalLM.set_eagle3_layers_to_capture(fake, ids)
        assert list(fake.model.layers_to_capture) == ([i + 1 for i in ids] if shifted else ids)
        assert list(fake.model.layers_to_capture) == engine_captured_layers(
            ids, engine="sglang", architecture="DeepseekV3ForCausalLM", num_layers=61)
    for arch, module in [("GlmMoeDsaForCausalLM", "glm4_moe"), ("MistralLarge3ForCausalLM", "mistral_large_3")]:
        assert arch_for(arch).sglang_rule == "first_id"
        try:
            cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), arch)
        except ImportError:
            continue  # needs GPU-only deps to import; the class hierarchy is checked where it imports
        assert issubclass(cls, ds.DeepseekV2ForCausalLM)


def test_every_listed_internal_exists_with_the_signature_we_call() -> None:
    import importlib

    cpu_unimportable = {"sglang:Engine"}  # sglang.srt.entrypoints.engine needs uvloop; checked on the GPU run
    for name in SGLANG_INTERNALS:
        module, attr = name.split(":")
        if name in cpu_unimportable:
            continue
        mod = importlib.import_module(module)
        assert hasattr(mod, attr), name
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    runner_params = set(inspect.signature(ModelRunner.__init__).parameters)
    assert {"model_config", "mem_fraction_static", "gpu_id", "tp_rank", "tp_size", "moe_ep_rank", "moe_ep_size",
            "pp_rank", "pp_size", "nccl_port", "server_args"} <= runner_params
    for meth in ("alloc_memory_pool", "init_attention_backends", "init_cuda_graphs", "forward"):
        assert callable(getattr(ModelRunner, meth)), meth
    assert {"reqs", "req_to_token_pool", "token_to_kv_pool_allocator", "tree_cache", "model_config",
            "enable_overlap", "spec_algorithm"} <= set(inspect.signature(ScheduleBatch.init_new).parameters)
    assert callable(ScheduleBatch.prepare_for_extend)
    assert {"rid", "origin_input_text", "origin_input_ids", "sampling_params"} <= set(
        inspect.signature(Req.__init__).parameters)
    assert callable(Req.set_extend_input_len)
    lp = list(inspect.signature(LogitsProcessor.forward).parameters)
    assert lp[:6] == ["self", "input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states"]


def test_gpu_check_settings_are_valid_sglang_args(folders: tuple[Path, Path]) -> None:
    """Every engine setting benchmarks/gpu_sglang.py launches with is a ServerArgs field sglang 0.5.14 accepts."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_sglang

    target, drafter = folders
    cfgs = [gpu_sglang._spec_engine_cfg(str(target)), gpu_sglang.target_cfg(str(target), "sglang",
                                                                             mem_fraction_static=0.6)]
    for cfg in cfgs:
        sa = ServerArgs(**engine_kwargs(str(target), cfg.sglang, dtype=cfg.dtype), **CPU_ONLY)
        assert sa.dtype == "bfloat16" and sa.disable_radix_cache is False
        cap = ServerArgs(**capture_server_kwargs(str(target), cfg.sglang, dtype=cfg.dtype), device="cuda")
        assert cap.disable_radix_cache is True
    kw, _ = speculative_engine_kwargs(str(target), cfgs[0].sglang, drafter, SpecConfig(), dtype="bfloat16")
    assert ServerArgs(**kw, **CPU_ONLY).speculative_algorithm == "EAGLE3"


def test_capture_tree_cache_stand_in_covers_sglangs_offline_driver() -> None:
    """Our no-prefix tree cache answers every method sglang's own offline driver (bench_one_batch) provides."""
    import ast
    import importlib.util

    from eaglenest.engines.sglang.capture import _NoPrefixCache

    spec = importlib.util.find_spec("sglang.bench_one_batch")
    assert spec is not None and spec.origin
    tree = ast.parse(Path(spec.origin).read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "TreeCacheNamespace")
    upstream = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
    assert upstream and upstream <= set(dir(_NoPrefixCache))
    fields = {kw.arg for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") ==
              "TreeCacheNamespace" for kw in n.keywords}
    assert fields == {"page_size", "device", "token_to_kv_pool_allocator"}


def test_streaming_surface_we_call() -> None:
    """What ``eaglenest.engines.sglang.stream`` uses: read from sglang's source (its engine module needs uvloop and a
    GPU-side import chain, so it is parsed rather than imported here; the GPU run exercises it)."""
    import ast
    import dataclasses
    import importlib.util

    def methods(module: str, cls: str) -> dict[str, ast.AST]:
        src = Path(importlib.util.find_spec(module).origin).read_text()
        node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == cls)
        return {f.name: f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def params(fn: ast.AST) -> set[str]:
        return {a.arg for a in fn.args.args + fn.args.kwonlyargs}

    engine = methods("sglang.srt.entrypoints.engine", "Engine")
    assert isinstance(engine["async_generate"], ast.AsyncFunctionDef)
    assert {"input_ids", "sampling_params", "stream", "rid"} <= params(engine["async_generate"])
    # request_kwargs: logprobs, and a constrained answer that starts inside its reasoning block
    assert {"return_logprob", "top_logprobs_num", "logprob_start_len", "require_reasoning"} <= \
        params(engine["async_generate"])
    assert "self.loop" in ast.unparse(engine["__init__"])
    assert "rid" in params(methods("sglang.srt.managers.tokenizer_manager", "TokenizerManager")["abort_request"])
    field = {f.name: f for f in dataclasses.fields(ServerArgs)}["incremental_streaming_output"]
    assert field.default is False  # and eaglenest pins it off: chunks are cumulative
    assert engine_kwargs("m", SGLangEngineConfig())["incremental_streaming_output"] is False


def test_loop_driver_surface() -> None:
    """What ``eaglenest.engines.sglang.driver`` relies on, read from sglang's source: a batch through
    ``async_generate`` without ``stream`` returns the outputs (one awaited item); the tokenizer manager starts its
    receive loop on the *running* loop (the driver's thread runs ``Engine.loop``) and installs signal handlers only
    from the main thread (the driver's thread is not)."""
    import ast
    import importlib.util

    def function(module: str, cls: str, name: str) -> str:
        src = Path(importlib.util.find_spec(module).origin).read_text()
        node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == cls)
        return ast.unparse(next(f for f in node.body if getattr(f, "name", None) == name))

    agen = function("sglang.srt.entrypoints.engine", "Engine", "async_generate")
    assert "return await generator.__anext__()" in agen
    loop = function("sglang.srt.managers.tokenizer_manager", "TokenizerManager", "auto_create_handle_loop")
    assert "get_or_create_event_loop()" in loop and "threading.main_thread()" in loop
    common = Path(importlib.util.find_spec("sglang.srt.utils.common").origin).read_text()
    helper = next(n for n in ast.walk(ast.parse(common))
                  if isinstance(n, ast.FunctionDef) and n.name == "get_or_create_event_loop")
    assert "asyncio.get_running_loop()" in ast.unparse(helper)


def test_generation_capture_launch_and_the_surface_its_hooks_read(folders: tuple[Path, Path]) -> None:
    """Capture during generation (eaglenest.engines.sglang.hooks) reads ForwardBatch fields, relies on Llama's call
    convention and module names, on hooks firing only outside CUDA graphs, and on Engine.generate taking rids."""
    import ast
    import dataclasses
    import importlib.util

    from sglang.srt.model_executor import model_runner
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.models.llama import LlamaDecoderLayer, LlamaModel

    from eaglenest.engines.sglang.args import generation_capture_kwargs
    from eaglenest.engines.sglang.hooks import hook_specs

    target, _ = folders
    kw = generation_capture_kwargs(engine_kwargs(str(target), SGLangEngineConfig()), hook_specs("/tmp/x", [2, 4, 5]))
    sa = ServerArgs(**kw, **CPU_ONLY)
    assert sa.forward_hooks == kw["forward_hooks"]
    assert sa.disable_radix_cache is True and sa.disable_cuda_graph is True
    assert {"rids", "forward_mode", "extend_seq_lens_cpu", "input_ids", "positions"} <= {
        f.name for f in dataclasses.fields(ForwardBatch)}
    assert ForwardMode.DECODE.is_decode() and ForwardMode.IDLE.is_idle()
    assert ForwardMode.EXTEND.is_extend() and ForwardMode.MIXED.is_extend() and not ForwardMode.DECODE.is_extend()
    assert list(inspect.signature(LlamaDecoderLayer.forward).parameters) == [
        "self", "positions", "hidden_states", "forward_batch", "residual"]
    src = " ".join(inspect.getsource(LlamaModel.forward).split())
    assert "aux_hidden_states.append(hidden_states + residual)" in src  # the stream EAGLE3 capture takes = ours
    assert "layer( positions, hidden_states, forward_batch, residual, )" in src
    assert "hidden_states, _ = self.norm(hidden_states, residual)" in src
    runner_src = inspect.getsource(model_runner)
    assert "register_forward_hooks(self.model, self.server_args.forward_hooks)" in runner_src
    engine_src = Path(importlib.util.find_spec("sglang.srt.entrypoints.engine").origin).read_text()
    engine_cls = next(n for n in ast.walk(ast.parse(engine_src)) if isinstance(n, ast.ClassDef) and n.name == "Engine")
    generate = next(f for f in engine_cls.body if isinstance(f, ast.FunctionDef) and f.name == "generate")
    assert "rid" in {a.arg for a in generate.args.args + generate.args.kwonlyargs}


def test_capture_hooks_through_sglangs_own_register_forward_hooks(tmp_path: Path) -> None:
    """The hook specs as sglang's hook manager resolves and attaches them, on tests/capture_toy.py's CPU stand-in."""
    import torch
    from capture_toy import AUX, H, Model, Scheduler
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

    from eaglenest.engines.base import CaptureHint
    from eaglenest.engines.sglang.recorded import GenerationRecorder

    model = Model()
    rec = GenerationRecorder(str(tmp_path), AUX, hidden_size=H, dtype="float32")
    register_forward_hooks(model, rec.hooks)
    rec.sink.start()
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12]]
    rids = rec.new_rids(2)
    gens = Scheduler(model).generate(prompts, [3, 2], rids)
    rec.expect(rids, prompts, gens)
    seqs = [p + g.token_ids for p, g in zip(prompts, gens, strict=True)]
    hints = [CaptureHint(g.meta["capture_ref"], [0] * len(p) + [1] * len(g.token_ids))
             for p, g in zip(prompts, gens, strict=True)]
    caps = rec.capture(seqs, hints, prefill=lambda s, r: pytest.fail("no prefill expected"))
    for seq, cap in zip(seqs, caps, strict=True):
        got = torch.cat([cap.aux_hidden_states, cap.last_hidden_state], dim=-1)
        torch.testing.assert_close(got[:-1], model.model.reference(seq)[:-1], rtol=1e-6, atol=1e-6)
    rec.close()


def test_deepseek_v2_layer_call_convention_the_hooks_read() -> None:
    """DeepseekV3/Kimi capture during generation reads DeepseekV2DecoderLayer's own convention (eaglenest.targets):
    the ForwardBatch at positional 2, a (hidden, residual, topk_indices) output whose hidden + residual is the stream
    SGLang's own EAGLE3 capture takes, and the final norm called on (hidden, residual)."""
    from sglang.srt.models.deepseek_v2 import DeepseekV2DecoderLayer, DeepseekV2Model
    from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration

    params = list(inspect.signature(DeepseekV2DecoderLayer.forward).parameters)
    assert params[:5] == ["self", "positions", "hidden_states", "forward_batch", "residual"]
    call = DEEPSEEK_V3.layer_call
    assert params[call.forward_batch_arg + 1] == "forward_batch"
    layer_src = " ".join(inspect.getsource(DeepseekV2DecoderLayer.forward).split())
    assert "return hidden_states, residual, topk_indices" in layer_src
    assert (call.output_hidden, call.output_residual, call.output_len) == (0, 1, 3)
    src = " ".join(inspect.getsource(DeepseekV2Model.forward).split())
    assert "hidden_states, residual, topk_indices = layer( positions, hidden_states, forward_batch, residual," in src
    assert "hidden_states, _ = self.norm(hidden_states, residual)" in src
    # Kimi-K2.5 keeps the DeepseekV3 model as language_model: the hooks' module paths name it
    init_src = inspect.getsource(KimiK25ForConditionalGeneration.__init__)
    assert "self.language_model = DeepseekV3ForCausalLM(" in " ".join(init_src.split())
    assert KIMI_K25.layer_module(0) == "language_model.model.layers.0"
    assert KIMI_K25.sglang_norm == "language_model.model.norm"


# ------------------------------------------------------------------------------------------- the MLA draft shape
@pytest.fixture(scope="module")
def sglang_model_parallel() -> None:
    sglang_shims.init_cpu_model_parallel()


def _sglang_mla(tmp_path: Path, monkeypatch, **drafter_kw):
    """(our MLA drafter, its export, sglang's draft ModelConfig, sglang's Eagle3DeepseekV2ForCausalLM for it)."""
    import sglang.srt.layers.rotary_embedding.base as rotary_base
    from mla_helpers import HEADS, H, V, mla_drafter
    from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    model, _, _ = mla_drafter(21, **drafter_kw)
    drafter = model.save_pretrained(tmp_path / "mla", dtype="float32")
    target = write_target(tmp_path / "target", architecture="DeepseekV3ForCausalLM", model_type="deepseek_v3",
                          hidden=H, heads=HEADS, kv_heads=HEADS, vocab=V, context=512)
    sa = ServerArgs(model_path=str(target), speculative_algorithm="EAGLE3", speculative_draft_model_path=str(drafter),
                    speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4, **CPU_ONLY)
    set_global_server_args_for_scheduler(sa)
    mc = ModelConfig.from_server_args(sa, model_path=str(drafter), is_draft_model=True)
    monkeypatch.setattr(rotary_base, "_is_cpu", True)  # the CPU box has no fallback rope kernel to bind (unused here)
    return model, drafter, mc, Eagle3DeepseekV2ForCausalLM(mc.hf_config)


@pytest.mark.parametrize("eagle31", [False, True])
def test_mla_export_through_sglangs_modelconfig_and_loader(tmp_path: Path, sglang_model_parallel, monkeypatch,
                                                           caplog, eagle31: bool) -> None:
    """Our MLA export, as sglang 0.5.14 reads it: ModelConfig's MLA branch, Eagle3DeepseekV2ForCausalLM built on the
    CPU, every one of its parameters written by its own load_weights from our file (none left at NaN, no name
    skipped), the d2t hot-token map, and the EAGLE-3.1 options read from our keys."""
    import logging

    import torch
    from safetensors.torch import load_file
    from sglang.srt.configs.model_config import AttentionArch

    ours, drafter, mc, model = _sglang_mla(tmp_path, monkeypatch, fc_norm=eagle31, norm_output=eagle31)
    cfg = ours.config
    assert mc.attention_arch == AttentionArch.MLA
    assert (mc.kv_lora_rank, mc.qk_nope_head_dim, mc.qk_rope_head_dim, mc.v_head_dim) == (
        cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
    assert mc.scaling == pytest.approx(ours.midlayer.self_attn.softmax_scale)
    assert mc.num_hidden_layers == 1 and mc.hf_config.draft_vocab_size == cfg.draft_vocab_size
    assert model.model.norm_output is eagle31 and (model.model.fc_norm is not None) is eagle31
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    tensors = load_file(str(drafter / "model.safetensors"))
    with caplog.at_level(logging.WARNING):
        model.load_weights(list(tensors.items()))
    assert "skipping unexpected weight" not in caplog.text
    a, s = "model.midlayer.self_attn.", "midlayer.self_attn."
    want = {name: tensors[name.removeprefix("model.")] for name in params if name.removeprefix("model.") in tensors}
    want[f"{a}fused_qkv_a_proj_with_mqa.weight"] = torch.cat([tensors[f"{s}q_a_proj.weight"],
                                                              tensors[f"{s}kv_a_proj_with_mqa.weight"]])
    want["model.midlayer.mlp.gate_up_proj.weight"] = torch.cat([tensors["midlayer.mlp.gate_proj.weight"],
                                                                tensors["midlayer.mlp.up_proj.weight"]])
    assert set(want) == set(params)  # every sglang parameter has a source in our file
    for name, p in params.items():  # vocab-parallel layers pad their rows; the rest must match exactly
        got = p.detach()[: want[name].shape[0]]
        torch.testing.assert_close(got, want[name], rtol=0, atol=0, msg=name)
    d2t = tensors["d2t"]
    assert torch.equal(model.hot_token_id, d2t + torch.arange(d2t.numel()))
    assert model.model.midlayer.self_attn.w_kc is not None  # post_load_weights split kv_b_proj


def test_mla_attention_inputs_as_sglangs_mla_prepares_them(tmp_path: Path, sglang_model_parallel,
                                                           monkeypatch) -> None:
    """q, k, v of our MLA attention == what sglang's DeepseekV2AttentionMLA prepares from the same weights and
    input (forward_normal_prepare's steps, run with sglang's own projections, norms and rotary embedding), and
    the layer/model forwards keep the EAGLE-3 wiring our model implements (residual, 2H input, aux output)."""
    import torch
    from safetensors.torch import load_file
    from sglang.srt.models import kimi_k25_eagle3
    from sglang.srt.models.deepseek_common.attention_forward_methods import forward_mha

    ours, drafter, _, model = _sglang_mla(tmp_path, monkeypatch)
    cfg = ours.config
    model.load_weights(list(load_file(str(drafter / "model.safetensors")).items()))
    attn = model.model.midlayer.self_attn
    assert attn.rotary_emb.is_neox_style is False and attn.scaling == pytest.approx(cfg.qk_head_dim ** -0.5)

    n, nope, rope, heads = 7, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.num_attention_heads
    x = torch.randn(n, 2 * cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(3, 3 + n)
    with torch.no_grad():
        q_lat, latent = attn.fused_qkv_a_proj_with_mqa(x)[0].split([attn.q_lora_rank,
                                                                    attn.kv_lora_rank + attn.qk_rope_head_dim], -1)
        q = attn.q_b_proj(attn.q_a_layernorm.forward_native(q_lat))[0].view(-1, heads, nope + rope)
        kv_a = attn.kv_a_layernorm.forward_native(latent[:, : attn.kv_lora_rank])
        k_pe = latent[:, None, attn.kv_lora_rank:]
        q_pe, k_pe = attn.rotary_emb.forward_native(positions, q[..., nope:].clone(), k_pe.clone())
        kv = attn.kv_b_proj(kv_a)[0].view(-1, heads, nope + cfg.v_head_dim)
        sg_q = torch.cat([q[..., :nope], q_pe], -1)
        sg_k = torch.cat([kv[..., :nope], k_pe.expand(-1, heads, -1)], -1)
        sg_v = kv[..., nope:]
        oq, ok, ov = ours.midlayer.self_attn.qkv(x[None], positions[None])
    for mine, theirs in ((oq, sg_q), (ok, sg_k), (ov, sg_v)):
        torch.testing.assert_close(mine[0].transpose(0, 1), theirs, rtol=1e-5, atol=1e-6)

    def src(fn) -> str:
        return " ".join(inspect.getsource(fn).split())

    prepare = src(forward_mha.DeepseekMHAForwardMixin.forward_normal_prepare)  # the steps transcribed above
    for step in ("split( [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1, )",
                 "q = self.q_a_layernorm(q) q = self.q_b_proj(q)[0].view(-1, self.num_local_heads, self.qk_head_dim)",
                 "kv_a = self.kv_a_layernorm(kv_a)", "k_pe = latent_cache[:, :, self.kv_lora_rank :]",
                 "q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)"):
        assert step in prepare, step
    layer = src(kimi_k25_eagle3.Eagle3MLADecoderLayer.forward)
    for step in ("residual = hidden_states", "embeds = self.input_layernorm(embeds)",
                 "hidden_states = self.hidden_norm(hidden_states)", "torch.cat([embeds, hidden_states], dim=-1)",
                 "self.post_attention_layernorm(attn_out, residual)", "hidden_states = self.mlp(hidden_states)"):
        assert step in layer, step
    fwd = src(kimi_k25_eagle3.Eagle3MLAModel.forward)
    assert "aux = hidden_states_to_logits if self.norm_output else hidden_states_to_aux" in fwd
    assert "hidden_states.chunk(self.num_aux_hidden_states, dim=-1)" in fwd
    loader = src(kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM.load_weights)
    assert 're.sub(r"^layers\\.0\\.", "midlayer.", name)' in loader and 'f"model.{mapped_name}"' in loader


def test_structured_output_reaches_sglangs_sampling_params_and_grammar_backends() -> None:
    """A constrained request's sampling dict is one SGLang's SamplingParams takes and verifies (its schema under
    ``json_schema``), and the grammar backends the 400's fix names are SGLang's own choices."""
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSampling
    from sglang.srt.server_args import GRAMMAR_BACKEND_CHOICES

    from eaglenest.engines.base import OutputConstraint, SamplingParams
    from eaglenest.engines.sglang.args import sampling_params_dict
    from eaglenest.speculative.guide import canonical_schema

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    sp = sampling_params_dict(SamplingParams(max_new_tokens=8, constraint=OutputConstraint(canonical_schema(schema))))
    theirs = SGLangSampling(**sp)
    theirs.verify(1000)
    assert theirs.json_schema == canonical_schema(schema)
    assert {"xgrammar", "llguidance", "none"} <= set(GRAMMAR_BACKEND_CHOICES)
