"""The overlay on the real SGLang 0.5.23 package (no GPU): its seam table, server arguments through the CLI, the
environment, resolution, pickling and copies, the FlashInfer-fusion switch inside SGLang's own resolution
pipeline, and the version-neutral lookups as 0.5.23 answers them. Version-independent checks (every seam
patched and restored, idempotence, refusal of unknown versions, ...) live in test_seams.py and run
here too."""

from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from tests.sglang_versions import requires_sglang

pytestmark = requires_sglang("0.5.23")
pytest.importorskip("sglang")

from sglang_sm120 import seams  # noqa: E402
from sglang_sm120.core import config  # noqa: E402
from sglang_sm120.hooks import distributed as hooks_distributed  # noqa: E402
from sglang_sm120.hooks import server_args as hooks_server_args  # noqa: E402
from sglang_sm120.seams import base  # noqa: E402


def applied_targets() -> list[str]:
    """The targets of the seams applied now, in the order they were applied."""
    with base._lock:
        return [entry.seam.target for entry in base._applied]


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture
def tiny_model(tmp_path):
    """A local config.json: enough for SGLang's resolution pipeline to run on CPU past the dummy-model exit."""
    config_json = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    # SGLang's resolution exports settings to os.environ (handle_environment_variables); keep them out of
    # the tests that follow.
    saved = dict(os.environ)
    yield str(tmp_path)
    os.environ.clear()
    os.environ.update(saved)


def test_installed_version_selects_the_0523_table():
    assert seams.sglang_version() == "0.5.23"
    assert "0.5.23" in seams.SEAM_TABLES
    table = seams.load_table()
    assert table.SGLANG_VERSION == "0.5.23"
    targets = {seam.target for seam in table.SEAMS}
    # 0.5.13.post1 seams that must not be carried over: a replaced __post_init__ never runs under msgspec, and
    # the EAGLE-3 / should-fuse guards target code that is gone.
    assert "sglang.srt.server_args:ServerArgs.__post_init__" not in targets
    assert not any("layers.communicator" in t or "set_eagle3_layers" in t for t in targets)


def test_table_targets_and_reads_resolve():
    table = seams.load_table()
    base.check_resolvable([seam.target for seam in table.SEAMS] + list(table.READS))


def test_activation_before_import_patches_on_import_in_a_fresh_interpreter():
    """The launcher and scheduler case: nothing of SGLang's srt imported when the plugin activates."""
    code = textwrap.dedent(
        """
        import importlib, sys
        import sglang_sm120
        from sglang_sm120 import seams
        from sglang_sm120.seams import base
        sglang_sm120.activate()
        assert not any(m.startswith("sglang.srt.layers") for m in sys.modules), "activation imported SGLang"
        table = seams.load_table()
        assert sorted(base.pending_targets()) == sorted(s.target for s in table.SEAMS), base.pending_targets()
        for module in sorted({s.module_name for s in table.SEAMS}):
            importlib.import_module(module)
        assert base.pending_targets() == []
        assert sorted(e.seam.target for e in base._applied) == sorted(s.target for s in table.SEAMS)
        print("OK")
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "python"), REPO]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-4000:]


# ---------------------------------------------------------------------------------------------------------
# server arguments


def parse(*argv):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "dummy", *argv]))


def stored(server_args) -> config.OverlaySettings:
    found = getattr(server_args, config.SETTINGS_ATTR)
    assert isinstance(found, config.OverlaySettings)
    return found


def test_cli_flags_survive_resolution_and_the_pickle_to_schedulers(overlay, clean_env):
    before = dict(os.environ)
    server_args = parse("--sm120-allreduce", "on", "--sm120-allreduce-max-bytes", "65536", "--sm120-allreduce-tune",
                        "force")
    server_args.resolve_once()
    assert server_args._resolution_finished
    clone = pickle.loads(pickle.dumps(server_args))  # what each scheduler process receives
    assert stored(clone) == config.OverlaySettings("on", 65536, "force")
    clone.resolve_once()  # publish() calls it again in the scheduler: the sealed record is not written
    assert config.settings_of(clone, {}) == config.OverlaySettings("on", 65536, "force")
    assert {k: v for k, v in os.environ.items() if k.startswith("SGLANG_SM120")} == \
        {k: v for k, v in before.items() if k.startswith("SGLANG_SM120")}  # nothing exported


def test_the_command_line_record_holds_the_defaults_before_resolution(overlay, clean_env):
    server_args = parse()
    assert stored(server_args) == config.OverlaySettings()
    server_args.resolve_once()
    assert stored(server_args) == config.OverlaySettings()


def test_copies_rebuilt_from_the_fields_read_their_own_environment(overlay, clean_env, monkeypatch):
    """SGLang hands the record to its schedulers by pickling it, which keeps the settings; msgspec's own copies
    rebuild from the fields only (SGLang does not use them on the way to a scheduler), and a process holding such a
    copy reads its own environment: the flags are not copied into it."""
    import msgspec

    server_args = parse("--sm120-allreduce", "off", "--sm120-allreduce-max-bytes", "4096")
    assert stored(copy.deepcopy(server_args)) == config.OverlaySettings("off", 4096)
    shallow = copy.copy(server_args)
    replaced = msgspec.structs.replace(server_args, model_path="other")
    monkeypatch.setenv(config.MODE_ENV, "on")
    for record in (shallow, replaced):
        assert getattr(record, config.SETTINGS_ATTR, None) is None
        assert config.settings_of(record) == config.OverlaySettings("on", None)


def test_engine_api_reads_the_environment_at_resolve_once(overlay, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv(config.MODE_ENV, "off")
    monkeypatch.setenv(config.MAX_BYTES_ENV, "4096")
    monkeypatch.setenv(config.TUNE_ENV, "off")
    server_args = ServerArgs(model_path="dummy")  # what sglang.Engine(**kwargs) builds
    assert getattr(server_args, config.SETTINGS_ATTR, None) is None  # 0.5.23 has no __post_init__ to fill them
    server_args.resolve_once()  # what Engine._launch_subprocesses calls
    assert stored(server_args) == config.OverlaySettings("off", 4096, "off")
    clone = pickle.loads(pickle.dumps(server_args))
    assert config.settings_of(clone, {}) == config.OverlaySettings("off", 4096, "off")


def test_bad_env_value_fails_at_resolution_naming_the_variable(overlay, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv(config.MODE_ENV, "sometimes")
    server_args = ServerArgs(model_path="dummy")
    with pytest.raises(ValueError, match=config.MODE_ENV):
        server_args.resolve_once()


def test_resolve_once_wrapper_leaves_a_sealed_record_alone(clean_env):
    calls = []
    resolve_once = hooks_server_args.wrap_resolve_once(lambda self: calls.append("original"))
    sealed = SimpleNamespace(_resolution_finished=True)
    resolve_once(sealed)
    assert calls == ["original"] and not hasattr(sealed, config.SETTINGS_ATTR)
    fresh = SimpleNamespace()
    resolve_once(fresh)
    assert stored(fresh) == config.OverlaySettings() and calls == ["original", "original"]


def test_an_error_of_sglangs_resolve_once_shows_no_frame_of_ours(clean_env):
    """A wrapper on the stack would put hooks/server_args.py into every traceback of SGLang's own resolution."""
    import traceback

    def resolve_once(self):
        raise ValueError("SGLang's own complaint")

    class Record:
        pass

    Record.resolve_once = hooks_server_args.wrap_resolve_once(resolve_once)
    record = Record()
    with pytest.raises(ValueError, match="own complaint") as caught:
        record.resolve_once()
    frames = [frame.filename for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert not any(os.sep + "sglang_sm120" + os.sep in name for name in frames), frames
    assert stored(record) == config.OverlaySettings()  # our part ran, at the lookup


@pytest.mark.parametrize(
    "capability,mode,requested,expected",
    [
        ((12, 0), "auto", "trtllm", None),
        ((12, 0), "on", "auto", None),
        ((12, 1), "auto", "auto", None),  # every SM12x: FlashInfer's backend resolution accepts SM90/SM100 only
        ((12, 0), "off", "trtllm", "trtllm"),  # overlay off: SGLang untouched
        ((9, 0), "auto", "trtllm", "trtllm"),
        ((10, 0), "auto", "auto", "auto"),
        (None, "auto", "trtllm", "trtllm"),  # no GPU seen: nothing to decide
        ((12, 0), "auto", None, None),
    ],
)
def test_flashinfer_fusion_declared_off_on_sm12x(clean_env, capability, mode, requested, expected):
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy", flashinfer_allreduce_fusion_backend=requested)
    setattr(server_args, config.SETTINGS_ATTR, config.OverlaySettings(mode))
    changed = hooks_server_args.keep_flashinfer_fusion_off_on_sm12x(server_args, capability=capability)
    assert resolution_result(server_args, "flashinfer_allreduce_fusion_backend") == expected
    assert changed == (requested is not None and expected is None)
    assert server_args.flashinfer_allreduce_fusion_backend == requested  # the operator's input is not written


@pytest.mark.parametrize("capability,expected", [((12, 0), None), ((9, 0), "trtllm")])
def test_fusion_switch_inside_sglangs_resolution_pipeline(overlay, monkeypatch, tiny_model, capability, expected):
    """The real pipeline, past the dummy-model exit, runs our step: the published config has fusion off."""
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setattr(hooks_server_args, "_device_capability", lambda: capability)
    server_args = ServerArgs(
        model_path=tiny_model, device="cpu", skip_tokenizer_init=True, flashinfer_allreduce_fusion_backend="trtllm"
    )
    server_args.resolve_once()
    assert resolution_result(server_args, "flashinfer_allreduce_fusion_backend") == expected


def test_deprecated_fusion_flag_is_also_switched_off_on_sm12x(overlay, monkeypatch, tiny_model):
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setattr(hooks_server_args, "_device_capability", lambda: (12, 0))
    server_args = ServerArgs(model_path=tiny_model, device="cpu", skip_tokenizer_init=True,
                             enable_flashinfer_allreduce_fusion=True)
    server_args.resolve_once()
    assert resolution_result(server_args, "flashinfer_allreduce_fusion_backend") is None


def test_pipeline_step_keeps_its_name_for_sglangs_plugin_overrides(overlay):
    from sglang.srt.arg_groups import model_hook

    assert model_hook.handle_model_specific_adjustments.__name__ == "handle_model_specific_adjustments"
    assert base.is_ours(model_hook.handle_model_specific_adjustments)


# ---------------------------------------------------------------------------------------------------------
# lookups that moved in 0.5.23


def test_runtime_server_args_comes_from_the_runtime_context(monkeypatch):
    from sglang.srt import runtime_context
    from sglang.srt.server_args import get_global_server_args

    with pytest.raises(RuntimeError):
        get_global_server_args()  # why the 0.5.13 accessor cannot be used here
    published = object()
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: published)
    assert hooks_distributed.runtime_server_args() is published

    def unpublished():
        raise ValueError("Global server args is not set yet!")

    monkeypatch.setattr(runtime_context, "get_server_args", unpublished)
    assert hooks_distributed.runtime_server_args() is None


def test_default_store_falls_back_to_sglangs_tcp_store(monkeypatch):
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from sglang.srt.distributed import utils

    store = object()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)

    def no_default_store():
        raise RuntimeError("moved")

    monkeypatch.setattr(c10d, "_get_default_store", no_default_store)
    monkeypatch.setattr(utils, "get_global_tcp_store", lambda: store)
    assert hooks_distributed.default_store() is store


def test_tp_backend_uses_the_runtime_tp_group_without_the_deprecated_getter(monkeypatch):
    import warnings

    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state

    backend = object()
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: SimpleNamespace(
        tp_group=SimpleNamespace(sm120_backend=backend)))
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: 1 / 0)  # never asked
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert hooks_distributed.tp_backend() is backend


def test_piecewise_probe_follows_tc_piecewise_graphs_not_breakable_ones(monkeypatch):
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import enable_breakable_cuda_graph
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import (
        enable_tc_piecewise_cuda_graph,
    )

    monkeypatch.setattr(hooks_distributed, "_in_piecewise", None)
    assert not hooks_distributed.must_use_original()
    with enable_tc_piecewise_cuda_graph():
        assert hooks_distributed.must_use_original()
    with enable_breakable_cuda_graph():  # deliberate: see must_use_original
        assert not hooks_distributed.must_use_original()
    assert not hooks_distributed.must_use_original()


def test_missing_piecewise_probe_is_loud_and_keeps_sglangs_path(monkeypatch, caplog):
    monkeypatch.setattr(hooks_distributed, "_in_piecewise", None)
    monkeypatch.setattr(hooks_distributed, "PIECEWISE_PROBES", (("sglang.no_such_module", "flag"),))
    with caplog.at_level("ERROR", logger="sglang_sm120"):
        assert hooks_distributed.must_use_original() is True
    assert "no piecewise-CUDA-graph flag" in caplog.text


def test_deterministic_switch_is_the_resolved_one(clean_env):
    from sglang.srt.arg_groups.overrides import declare_resolution
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="dummy")
    assert not hooks_distributed.deterministic_inference(server_args)
    # what SGLang's handle_deterministic_inference declares for --rl-on-policy-target
    declare_resolution(server_args, "test", enable_deterministic_inference=True)
    assert server_args.enable_deterministic_inference is False
    assert hooks_distributed.deterministic_inference(server_args)


def test_seams_run_inside_sglangs_own_distributed_init_on_cpu():
    """publish() + init_distributed_environment (gloo, one rank) + initialize_model_parallel, in a fresh
    interpreter: our GroupCoordinator.__init__ runs on SGLang's real TP group and the published record is the
    one runtime_server_args finds. (One CPU rank: the backend itself stays off, as it must off CUDA.)"""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = textwrap.dedent(
        f"""
        import warnings
        warnings.simplefilter("ignore")
        import torch
        import sglang_sm120
        sglang_sm120.activate()
        from sglang.srt.runtime_context import SpawnRanks, publish
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.distributed import parallel_state as ps
        from sglang_sm120.hooks import distributed as hooks_distributed
        from sglang_sm120.seams import base
        server_args = ServerArgs(model_path="dummy", device="cpu")
        server_args.resolve_once()
        publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
        assert hooks_distributed.runtime_server_args() is server_args
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method="tcp://127.0.0.1:{port}")
        ps.initialize_model_parallel()
        assert base.is_ours(ps.GroupCoordinator.__dict__["__init__"])
        import warnings
        from sglang.srt.runtime_context import get_parallel
        tp = get_parallel().tp_group
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            assert hooks_distributed.sglang_group("tp_group") is tp
        assert tp.unique_name.startswith("tp:") and "sm120_backend" in vars(tp) and tp.sm120_backend is None
        x = torch.ones(2, 8)
        assert tp.all_reduce(x) is x
        print("OK")
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "python"), REPO]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
