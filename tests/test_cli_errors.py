"""Every error a user can cause ends an example CLI with one line ``error: <message>`` on stderr,
exit code 2 and no traceback (``--debug``: the traceback); under torchrun the ranks that agree
print it once (funcpar.train.cli)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _examples import load_example

from funcpar.testing import run_ranks
from funcpar.train.cli import EXIT_CODE, report_error, run_cli

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_lm.py"


train_lm = load_example("train_lm.py", "train_lm_cli")


def _tiny(tmp: Path, *extra: str) -> list[str]:
    return ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--dim", "16", "--layers",
            "1", "--heads", "2", "--device", "cpu", "--corpus-bytes", "60000", "--data-cache",
            str(tmp / "dc"), "--logdir", str(tmp / "tb"), *extra]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """One 2-step run's checkpoint, and a copy with a corrupt shard file."""
    tmp = tmp_path_factory.mktemp("cli")
    train_lm.main(_tiny(tmp, "--save-every", "2", "--ckpt-dir", str(tmp / "ck")))
    good = tmp / "ck" / "step_00000002"
    bad = tmp / "bad" / "step_00000002"
    bad.mkdir(parents=True)
    for f in good.iterdir():
        data = bytearray(f.read_bytes())
        if f.suffix == ".safetensors":
            data[-100] ^= 0xFF  # one flipped byte in a tensor: the checksum must catch it
        (bad / f.name).write_bytes(bytes(data))
    corpus = tmp / "corpus_with_binary"
    corpus.mkdir()
    (corpus / "notes.txt").write_text("some text\n" * 200, encoding="utf-8")
    (corpus / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    return tmp, good, bad


def _cases(tmp: Path, good: Path, bad: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, a phrase the one line must hold)."""
    return {
        "corrupt checkpoint": (_tiny(tmp, "--steps", "4", "--resume", str(bad)), "is corrupt"),
        "other model size": (_tiny(tmp, "--steps", "4", "--dim", "32", "--resume", str(good)),
                             "--dim 32"),
        "world size": (_tiny(tmp, "--tp", "2"), "torchrun --nproc_per_node 2"),
        "missing corpus": (_tiny(tmp, "--corpus", str(tmp / "nope")), "does not exist"),
        "binary corpus file": (_tiny(tmp, "--corpus", str(tmp / "corpus_with_binary"),
                                     "--binary-files", "error"), "image.txt' is not text"),
    }


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_user_errors_are_one_line_with_exit_2(ckpts, capsys):
    tmp, good, bad = ckpts
    for name, (argv, phrase) in _cases(tmp, good, bad).items():
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            run_cli(train_lm.main, argv)
        assert exc.value.code == EXIT_CODE, name
        line = _one_line(capsys.readouterr().err)
        assert phrase in line, (name, line)


@pytest.mark.parametrize("flag, value", [("--save-every", "-1"), ("--galore-gap", "-5"),
                                         ("--experts", "-2"), ("--kv-heads", "0"),
                                         ("--corpus-bytes", "-1"), ("--top-k", "0")])
def test_a_negative_count_flag_is_refused_by_the_parser(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli(train_lm.parse_args, [flag, value])  # the parser alone: nothing trains
    assert exc.value.code == EXIT_CODE
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"{flag} must be" in errors[0] and value in errors[0], errors
    # 0 where 0 means off.
    assert train_lm.parse_args(["--save-every", "0", "--experts", "0"]).save_every == 0


def test_binary_corpus_files_are_skipped_by_default(ckpts):
    tmp, _, _ = ckpts
    args = train_lm.parse_args(_tiny(tmp, "--corpus", str(tmp / "corpus_with_binary")))
    with pytest.warns(UserWarning, match=r"skipped 1 corpus file\(s\).*image\.txt"):
        loader = train_lm.load_batches(args, torch.device("cpu"))
    assert bytes(loader.tokens.tolist()) == b"some text\n" * 200


def test_debug_shows_the_traceback(ckpts):
    tmp, good, bad = ckpts
    argv, _ = _cases(tmp, good, bad)["corrupt checkpoint"]
    with pytest.raises(ValueError, match="is corrupt"):
        run_cli(train_lm.main, [*argv, "--debug"])


def _cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_script_prints_one_line(ckpts):
    """The user's command line: the script itself, in its own interpreter."""
    tmp, good, bad = ckpts
    argv, phrase = _cases(tmp, good, bad)["corrupt checkpoint"]
    proc = _cli(argv, tmp)
    assert proc.returncode == EXIT_CODE, proc.stderr
    assert phrase in _one_line(proc.stderr)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["other model size", "world size", "missing corpus"])
def test_the_script_prints_one_line_slow(ckpts, name):
    tmp, good, bad = ckpts
    argv, phrase = _cases(tmp, good, bad)[name]
    proc = _cli(argv, tmp)
    assert proc.returncode == EXIT_CODE, proc.stderr
    assert phrase in _one_line(proc.stderr)


def _report(messages: list[str]) -> str:
    import torch.distributed as dist

    out = io.StringIO()
    report_error(messages[dist.get_rank()], stream=out)
    return out.getvalue()


def test_ranks_that_agree_print_once_and_others_name_their_rank():
    same = run_ranks(_report, 2, ["bad checkpoint", "bad checkpoint"], timeout=30)
    assert same == ["error: bad checkpoint\n", ""]
    apart = run_ranks(_report, 2, ["fine on 0", "corpus missing on 1"], timeout=30)
    assert apart == ["error: fine on 0\n", "error: rank 1: corpus missing on 1\n"]
