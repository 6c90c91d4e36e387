"""examples/finetune_hf.py: a local Hugging Face causal LM (tiny Llama, tiny Mixtral; sharded
safetensors in) fine-tuned under funcpar and written back; transformers loads it with the
logits the trained state computes (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
from _examples import load_example

from funcpar.testing import run_ranks

transformers = pytest.importorskip("transformers")
finetune_hf = load_example("finetune_hf.py", "finetune_hf_issue34")


def _tiny(path, family="llama"):
    """A tiny model saved with save_pretrained, in several safetensors shards."""
    torch.manual_seed(0)
    common = {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64}
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2))
    model.save_pretrained(path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").exists()  # sharded input
    return path


def _args(model, out, cache, *extra):
    return ["--model", str(model), "--out", str(out), "--steps", "3", "--batch-size", "4",
            "--seq-len", "16", "--lr", "1e-2", "--corpus-bytes", "100000", "--data-cache",
            str(cache), "--logdir", str(out) + "_tb", "--max-shard-size", "60KB", *extra]


def _check_round_trip(out, params):
    """transformers loads ``out``; its logits equal those of ``params`` in the model."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    _, unexpected = reference.load_state_dict(params, strict=False)
    assert not unexpected
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = loaded(ids).logits
        from funcpar.state import functionalize

        apply_fn, _, b = functionalize(reference)
        got, _ = apply_fn(params, b, ids)
    err = float((a - got.logits).abs().max() / a.abs().max())
    assert err <= 1e-5, err


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_round_trip_one_process(tmp_path, family):
    model = _tiny(tmp_path / "in", family)
    out = finetune_hf.main(_args(model, tmp_path / "out", tmp_path / "cache",
                                 "--eval-every", "3", "--sample-every", "3"))
    assert len(out["losses"]) == 3 and out["evals"][0]["step"] == 3
    before = transformers.AutoModelForCausalLM.from_pretrained(model).state_dict()
    assert any(not torch.equal(before[k], v) for k, v in out["params"].items())  # it trained
    _check_round_trip(tmp_path / "out", out["params"])


def _ranked(model, out, cache, extra):
    return finetune_hf.main(_args(model, out, cache, *extra))["params"]


# The layout's training against one process's: in float64 to 1e-10; Mixtral's experts run
# transformers' grouped matmul, which takes float32 only, where Adam amplifies the reordered
# sums' round-off (Llama float32: 1.2e-5 after 3 steps here), so 1e-4.
@pytest.mark.parametrize("family,world,extra,dtype,tol", [
    pytest.param("llama", 2, ("--tp", "2"), "float64", 1e-10, marks=pytest.mark.slow),
    pytest.param("llama", 4, ("--tp", "2", "--zero", "2"), "float64", 1e-10,
                 marks=pytest.mark.slow),
    pytest.param("mixtral", 2, ("--tp", "2"), "float32", 1e-4, marks=pytest.mark.slow),
], ids=["llama-tp2", "llama-tp2xdp2+zero2", "mixtral-tp2"])
def test_round_trip_parallel(tmp_path, family, world, extra, dtype, tol):
    model = _tiny(tmp_path / "in", family)
    extra = (*extra, "--dtype", dtype)
    want = finetune_hf.main(_args(model, tmp_path / "one", tmp_path / "cache",
                                  "--dtype", dtype))["params"]
    got = run_ranks(_ranked, world, model, tmp_path / "out", tmp_path / "cache", extra,
                    backend=None, timeout=600)
    for name, p in want.items():  # the layout trained as one process did
        err = float((got[0][name] - p).abs().max() / p.abs().max())
        assert err <= tol, (name, err)
    _check_round_trip(tmp_path / "out", got[0])


def _export_args(model, out, cache, ckpt):
    return _args(model, out, cache, "--export-from", str(ckpt))


def test_export_from_a_checkpoint_one_process(tmp_path):
    """``--save-every`` writes funcpar checkpoints; ``--export-from`` writes one of them as a
    Hugging Face directory with the logits of the trained state."""
    model = _tiny(tmp_path / "in")
    trained = finetune_hf.main(_args(model, tmp_path / "out", tmp_path / "cache",
                                     "--save-every", "3", "--ckpt-dir", str(tmp_path / "ck")))
    out = finetune_hf.main(_export_args(model, tmp_path / "exported", tmp_path / "cache",
                                        tmp_path / "ck" / "step_00000003"))
    assert out["losses"] == []
    for k, v in trained["params"].items():
        assert torch.equal(out["params"][k], v), k
    _check_round_trip(tmp_path / "exported", trained["params"])


@pytest.mark.slow
def test_export_from_a_tp2xdp2_zero2_checkpoint(tmp_path):
    """A checkpoint saved under tp2 x dp2 + ZeRO-2 (4 ranks, float64), exported in one process:
    transformers loads it with the logits of the 4-rank run's trained parameters."""
    model = _tiny(tmp_path / "in")
    extra = ("--tp", "2", "--zero", "2", "--dtype", "float64", "--save-every", "3",
             "--ckpt-dir", str(tmp_path / "ck"))
    got = run_ranks(_ranked, 4, model, tmp_path / "out", tmp_path / "cache", extra,
                    backend=None, timeout=600)[0]
    out = finetune_hf.main(_export_args(model, tmp_path / "exported", tmp_path / "cache",
                                        tmp_path / "ck" / "step_00000003")
                           + ["--dtype", "float64"])
    for k, v in got.items():
        assert torch.equal(out["params"][k], v), k
    _check_round_trip(tmp_path / "exported", got)
