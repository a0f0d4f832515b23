"""The `radixserve` console script: `plugins`, `generate`, `serve` delegation and error lines."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from radixserve.core.interfaces import PLUGIN_KINDS
from radixserve.entrypoints import cli

SCRIPT = Path(sys.executable).parent / "radixserve"
# Modules that listing plugins or printing --help must never import.
VENDOR_MODULES = ("triton", "xgrammar", "flashinfer", "outlines", "llguidance", "mooncake", "nixl")


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert SCRIPT.is_file(), f"console script {SCRIPT} missing; run `pip install -e .`"
    proc = subprocess.run(
        [str(SCRIPT), *args],
        capture_output=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    # Decode by hand: text=True would turn a generated "\r" into "\n".
    return subprocess.CompletedProcess(
        proc.args, proc.returncode, proc.stdout.decode(), proc.stderr.decode()
    )


def assert_one_error_line(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def test_plugins_lists_every_kind_with_status_and_plugin() -> None:
    proc = run_cli("plugins")
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.splitlines()
    assert header.split() == ["KIND", "NAME", "STATUS", "PLUGIN", "REASON/DESCRIPTION"]
    cells = [row.split(maxsplit=4) for row in rows]
    assert {c[0] for c in cells} == set(PLUGIN_KINDS)
    assert ["attention", "torch_native", "available", "torch_native"] in [c[:4] for c in cells]
    assert ["hardware", "cpu", "available", "cpu", "host CPU (float32)"] in cells
    assert ["model", "LlamaForCausalLM", "available", "llama"] in [c[:4] for c in cells]


def test_plugins_json_groups_entries_by_kind() -> None:
    proc = run_cli("plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    listing = json.loads(proc.stdout)
    assert list(listing) == list(PLUGIN_KINDS)
    grammar = {e["name"]: e for e in listing["grammar"]}
    assert grammar["none"] == {
        "name": "none",
        "status": "available",
        "plugin": "grammar_none",
        "reason": None,
        "description": "no constrained decoding",
        "priority": 0,
    }


def test_plugins_says_which_model_families_accept_images() -> None:
    listing = cli.plugin_listing(cli.default_host())
    images = {e["name"]: e["images"] for e in listing["model"]}
    assert images["Qwen2VLForConditionalGeneration"] is True
    assert images["Qwen2_5_VLForConditionalGeneration"] is True
    assert images["LlavaForConditionalGeneration"] is True
    assert images["Idefics3ForConditionalGeneration"] is True
    assert images["SmolVLMForConditionalGeneration"] is True
    assert images["LlamaForCausalLM"] is False and images["Qwen2ForCausalLM"] is False


def test_plugin_that_fails_to_import_is_one_error_line(tmp_path: Path) -> None:
    # A distribution on PYTHONPATH whose entry point's module raises on import.
    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[radixserve]\nbroken = broken_plugin_mod\n")
    (tmp_path / "broken_plugin_mod.py").write_text("raise ImportError('needs libfoo.so')\n")
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    proc = run_cli("plugins", env={"PYTHONPATH": path})
    assert_one_error_line(
        proc, "plugin 'broken' (broken_plugin_mod) failed to import: needs libfoo.so"
    )
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_help_and_plugin_listing_import_no_vendor_library() -> None:
    script = textwrap.dedent(
        f"""
        import contextlib, io, sys
        from radixserve.entrypoints import cli
        cli.build_parser().format_help()
        assert "torch" not in sys.modules, "--help imported torch"
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli.main(["plugins"]) == 0
        vendor = sorted(m for m in sys.modules if m.split(".")[0] in {VENDOR_MODULES!r})
        assert not vendor, vendor
        import torch
        assert not torch.cuda.is_initialized(), "listing plugins initialized CUDA"
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_generate_with_an_unknown_plugin_is_one_error_line(tiny_llama_dir: Path) -> None:
    proc = run_cli(
        "generate", "--model-path", str(tiny_llama_dir), "--prompt", "Hi", "--plugin",
        "attention=nope",
    )  # fmt: skip
    assert_one_error_line(proc, "unknown attention plugin 'nope'", "torch_native")
    assert proc.stdout == ""


def test_generate_rejects_a_bad_sampling_value_with_one_line(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model-path", str(tiny_llama_dir), "--prompt", "Hi", "--max-new-tokens", "-1"]
    assert cli.main(["generate", *argv, "--max-total-tokens", "256"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "error: max_new_tokens must be >= 0, got -1\n"
    assert captured.out == ""


def test_generate_prints_the_engines_text(tiny_llama_dir: Path) -> None:
    from radixserve.entrypoints.engine import Engine

    prompt = "The quick brown fox"
    with Engine(str(tiny_llama_dir), max_total_tokens=1024) as engine:
        expected = engine.generate(
            prompt, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
        )
    assert len(expected["output_ids"]) == 6 and expected["text"]
    proc = run_cli(
        "generate", "--model-path", str(tiny_llama_dir), "--prompt", prompt,
        "--max-new-tokens", "6", "--temperature", "0", "--ignore-eos",
        "--max-total-tokens", "1024",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected["text"] + "\n"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--plugin", "attention"], "--plugin expects KIND=NAME, got 'attention'"),
        (["--plugin", "flux=capacitor"], "unknown plugin kind 'flux'"),
        (["--dtype", "fp8"], "unknown dtype 'fp8'; choose one of auto"),
        (["--log-level", "loud"], "unknown log level 'loud'"),
        (["--model-path", "/nonexistent/model"], "'/nonexistent/model' is not a model directory"),
        (
            ["--plugin", "grammar=xgrammar", "--plugin", "grammar=outlines"],
            "selects two grammar plugins, 'xgrammar' and 'outlines'; give one",
        ),
    ],
)
def test_generate_user_errors_before_loading(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["generate", "--prompt", "hi", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1
    assert fragment in captured.err
    assert captured.out == ""


def test_corrupt_model_files_are_one_error_line(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config.json that is not JSON, or a .gguf that is not GGUF: one line naming the file,
    not a traceback (they once raised JSONDecodeError and 'GGUF magic invalid')."""
    bad_json = tmp_path / "bad-json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    shutil.copy(tiny_llama_dir / "tokenizer.json", bad_json / "tokenizer.json")
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(bytes(range(256)) * 4)
    for model, fragment in ((bad_json, "is not a valid JSON file"), (not_gguf, "not a GGUF file")):
        argv = ["generate", "--prompt", "hi", "--model-path", str(model)]
        assert cli.main([*argv, "--max-total-tokens", "256"]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
        assert fragment in captured.err and str(model) in captured.err
        assert captured.out == ""


def test_serve_hands_every_later_argument_to_launch_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    received: list[list[str]] = []
    fake = types.ModuleType(cli.LAUNCH_SERVER_MODULE)
    fake.main = lambda argv: received.append(argv) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, cli.LAUNCH_SERVER_MODULE, fake)
    assert cli.main(["serve", "--help", "--port", "30001"]) == 7
    assert received == [["--help", "--port", "30001"]]


def test_format_table_aligns_columns() -> None:
    table = cli.format_table([("a", "long-name", "x"), ("bbb", "n", "free text")], ("K", "N", "D"))
    assert table.splitlines() == [
        "K    N          D",
        "a    long-name  x",
        "bbb  n          free text",
    ]
