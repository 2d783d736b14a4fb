"""One config: the generated command lines show every field with its help, defaults come from
``hawk/config.py`` alone, the child spec round-trips, and the static choice lists match the
registries that own those names."""

from __future__ import annotations

import dataclasses
import re

import pytest
from typer.testing import CliRunner

import hawk.config as config
from hawk.config import ConfigError, ServeConfig, defaults, options
from hawk.layouts.device import parse_device

WIDE = {"COLUMNS": "400", "TERM": "dumb", "NO_COLOR": "1"}


def _help(app, *args: str) -> str:
    r = CliRunner().invoke(app, [*args, "--help"], env=WIDE)
    assert r.exit_code == 0, r.output
    return re.sub(r"\s+", " ", r.output)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata["opt"].flag(f.name)


@pytest.mark.parametrize("command, args", [("serve", ["serve"]), ("demo", ["demo"]), ("bench", ["bench", "equivalence"])])
def test_every_field_is_an_option_with_its_help(command, args):
    from hawk.cli import app

    text = _help(app, *args)
    fields = options(command)
    assert fields
    for f in fields:
        assert _flag(f) in text, f.name
        assert re.sub(r"\s+", " ", f.metadata["opt"].help)[:30] in text, f.name


def test_serve_shows_every_field_and_vllm_names():
    from hawk.cli import app

    text = _help(app, "serve")
    assert {f.name for f in options("serve")} == {f.name for f in dataclasses.fields(ServeConfig)}
    for vllm in ("--api-key", "--served-model-name", "--max-model-len", "--max-num-seqs", "--log-level"):
        assert vllm in text


def test_a_default_changed_in_config_shows_in_every_command(monkeypatch):
    from hawk.cli import build_app

    field = next(f for f in dataclasses.fields(ServeConfig) if f.name == "arch")
    monkeypatch.setattr(field, "default", "wormhole-n300")
    app = build_app()
    for args in (["serve"], ["demo"], ["bench", "equivalence"]):
        assert "[default: wormhole-n300]" in _help(app, *args), args
    assert defaults().arch == "wormhole-n300"


def test_a_recorded_command_line_reads_back_into_its_config():
    """``parse_config`` reads argv with the generated options, so a run's recorded ``serve_args``
    give the settings it ran with; bad values and unknown flags raise, nothing prints and exits."""
    from hawk.config_cli import parse_config

    cfg = parse_config("serve", ["--transfer", "colocated", "--mixed-graphs", "--max-num-seqs", "128", "--step-token-target", "192"])
    assert (cfg.transfer, cfg.mixed_graphs, cfg.max_batch, cfg.step_token_target) == ("colocated", True, 128, 192)
    assert dataclasses.replace(cfg, transfer="gn-hawk", mixed_graphs=False, max_batch=None, step_token_target=0) == defaults()
    with pytest.raises(ConfigError, match="--step-token-target"):
        parse_config("serve", ["--step-token-target", "700"])
    with pytest.raises(ConfigError, match="--no-such-flag"):
        parse_config("serve", ["--no-such-flag"])


def test_the_default_model_is_one_constant():
    from hawk.engine.loader import DEFAULT_MODEL

    assert DEFAULT_MODEL is config.DEFAULT_MODEL and ServeConfig().model == config.DEFAULT_MODEL


def test_child_spec_round_trips_a_config():
    from hawk.serve.launcher import ChildSpec

    cfg = defaults(model="tiny", kv_tokens=512, served_model_name=["a", "b"], graphs=False, max_body_mb=1.5).validate()
    spec = ChildSpec("decode", cfg, "127.0.0.1", 0, "/tmp/r.json", 1)
    back = ChildSpec.from_json(spec.to_json())
    assert back == spec and back.config == cfg
    assert ServeConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ConfigError, match="unknown config keys"):
        ServeConfig.from_dict({**cfg.to_dict(), "from_the_future": 1})


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"port": 70000}, "--port must be in 0..65535"),
        ({"threads": 0}, "--threads must be at least 1"),
        ({"max_batch": 0}, "--max-num-seqs must be at least 1"),
        ({"transfer": "teleport"}, "unknown transfer 'teleport' (--transfer)"),
        ({"transfer": "gg-direct"}, "--decode-device must be cpu or cuda:N"),
        ({"decode_device": "npu-emu:tpu"}, "--decode-device: unknown device"),
        ({"max_body_mb": 0.0}, "--max-body-mb must be positive"),
    ],
)
def test_validation_names_the_option(change, needle):
    with pytest.raises(ConfigError) as e:
        defaults(**change).validate()
    assert needle in str(e.value)


def test_static_choices_match_their_registries():
    from hawk.connector.configs import CONFIGS
    from hawk.layouts.dtypes import GPU_DTYPES, NPU_DTYPES
    from hawk.layouts.npu import ARCHS
    from hawk.transport.registry import TRANSPORTS

    for name, decode_on in config.TRANSFERS.items():
        if name != "colocated":
            assert CONFIGS[name].decode_on == decode_on and CONFIGS[name].prefill_on != "npu", name
    assert set(CONFIGS) - set(config.TRANSFERS) == {c for c in CONFIGS if CONFIGS[c].prefill_on == "npu"}
    assert set(config.TRANSPORTS) == set(TRANSPORTS)
    assert set(config.ARCHS) == set(ARCHS)
    assert set(config.NPU_KV_DTYPES) == set(NPU_DTYPES)
    assert set(config.GPU_KV_DTYPES) == set(GPU_DTYPES)


@pytest.mark.parametrize(
    "text, kind, torch_device, memory, npu",
    [
        ("cpu", "cpu", "cpu", "cpu", False),
        ("cuda", "cuda", "cuda", "cuda", False),
        ("cuda:1", "cuda", "cuda:1", "cuda", False),
        ("npu-emu", "npu-emu", "cpu", "cpu", True),
        ("npu-emu:cpu", "npu-emu", "cpu", "cpu", True),
        ("npu-emu:cuda:1", "npu-emu", "cuda:1", "cuda", True),
        ("ttnn:0", "ttnn", "", "ttnn", True),
    ],
)
def test_device_strings_parse_once(text, kind, torch_device, memory, npu):
    d = parse_device(text)
    assert (d.kind, d.torch_device, d.memory_kind, d.is_npu) == (kind, torch_device, memory, npu)


@pytest.mark.parametrize("text", ["gpu", "cuda:x", "npu-emu:tpu", "ttnn", "npu-emu:cuda:"])
def test_bad_device_strings_are_refused(text):
    with pytest.raises(ValueError, match="expected cpu, cuda"):
        parse_device(text)


@pytest.mark.parametrize("args", [["bench", "serving"], ["sim"], ["bench", "efficiency"], ["report"]])
def test_pass_through_commands_show_their_real_options(args):
    from hawk.cli import app

    r = CliRunner().invoke(app, [*args, "--help"], env=WIDE)
    assert r.exit_code == 0, r.output
    assert r.output.count("--") > 3, r.output  # the tool's own options, not just --help


def test_tensor_parallel_ranks_take_consecutive_gpus():
    from hawk.layouts.device import rank_device

    assert rank_device("cuda:0", 1) == "cuda:1"
    assert rank_device("npu-emu:cuda:1", 2) == "npu-emu:cuda:3"
    assert rank_device("cuda", 1) == "cuda:1"
    assert rank_device("cpu", 3) == "cpu" and rank_device("npu-emu:cpu", 1) == "npu-emu:cpu"
    cfg = ServeConfig(prefill_device="cuda:0", decode_device="npu-emu:cuda:0", transfer="gn-hawk")
    assert cfg.for_rank("prefill", 1).prefill_device == "cuda:1"
    assert cfg.for_rank("prefill", 1).decode_device == "npu-emu:cuda:0"
    assert cfg.for_rank("decode", 1).decode_compute_device == "cuda:1"
    assert cfg.for_rank("decode", 0) is cfg
