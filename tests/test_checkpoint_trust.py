"""What a checkpoint's reader trusts (issue 20, items 2 and 4): the index names only files
inside the checkpoint, a malformed index is a CheckpointError naming the file and what is
wrong (never a KeyError/TypeError), ``latest_checkpoint`` warns about a damaged checkpoint it
skips, and a save replaces such a damaged directory.

A tiny state (one Linear, AdamW) keeps every case well under a second.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from funcpar.optim import adamw
from funcpar.state import CheckpointError, functionalize, init_state, latest_checkpoint, load, save


def _state(seed=0, step=0):
    torch.manual_seed(seed)
    _apply, params, buffers = functionalize(torch.nn.Linear(4, 3))
    state = init_state(params, buffers, adamw(lr=1e-2), seed=seed)
    return state._replace(step=torch.tensor(step))


def _rewrite_index(path, edit):
    """Apply ``edit`` to the parsed index (or the raw text, when it returns a str) and
    recompute COMPLETE's hash, as someone who can write the directory can."""
    ipath = os.path.join(path, "index.json")
    with open(ipath) as f:
        index = json.load(f)
    new = edit(index)
    text = new if isinstance(new, str) else json.dumps(index if new is None else new)
    with open(ipath, "w") as f:
        f.write(text)
    with open(os.path.join(path, "COMPLETE"), "w") as f:
        f.write(hashlib.sha256(text.encode()).hexdigest() + "\n")


def _first_sharded(index):
    return next(r for r in index["leaves"].values() if r["kind"] != "value")


def test_index_file_names_stay_inside_the_checkpoint(tmp_path):
    state = _state()
    path = save(state, tmp_path / "ck")
    outside = tmp_path / "x.safetensors"
    os.link(os.path.join(path, "rank00000.safetensors"), outside)  # a valid file, outside

    def escape(name):
        def edit(index):
            index["files"] = {name: index["files"]["rank00000.safetensors"]}
            for rec in index["leaves"].values():
                if rec["kind"] == "replicated":
                    rec["file"] = name
        return edit

    for name in ("../x.safetensors", str(outside), "sub/rank00000.safetensors", ".."):
        path = save(state, tmp_path / "ck")
        _rewrite_index(path, escape(name))
        with pytest.raises(CheckpointError, match=r"index\.json is malformed: file name "
                                                  r".* is not a plain name inside"):
            load(path, state)


def test_malformed_index_is_a_checkpoint_error(tmp_path):
    state = _state()
    edits = {
        "not JSON": (lambda ix: "{garbage", "is not valid JSON"),
        "a list": (lambda ix: [1, 2], "holds a list, not an object"),
        "no leaves": (lambda ix: ix.pop("leaves") and None, "'leaves' is NoneType"),
        "world_size a str": (lambda ix: ix.update(world_size="1"), "'world_size' is '1'"),
        "file size a str": (lambda ix: ix["files"]["rank00000.safetensors"].update(size="9"),
                            r"files\['rank00000.safetensors'\] is"),
        "leaf kind": (lambda ix: _first_sharded(ix).update(kind="mystery"),
                      "has kind 'mystery'"),
        "no global shape": (lambda ix: _first_sharded(ix).pop("global_shape") and None,
                            "has global_shape None"),
        "unknown file": (lambda ix: _first_sharded(ix).update(file="rank00009.safetensors"),
                         "names file 'rank00009.safetensors', which is not one of"),
        "leaf not an object": (lambda ix: ix["leaves"].update(step=7), "has kind None"),
    }
    for what, (edit, message) in edits.items():
        path = save(state, tmp_path / "ck")
        _rewrite_index(path, edit)
        with pytest.raises(CheckpointError, match=message) as err:
            load(path, state)
        assert "index.json" in str(err.value), what
    path = save(state, tmp_path / "ck")
    os.remove(os.path.join(path, "index.json"))
    with pytest.raises(CheckpointError, match="has a COMPLETE marker but no index.json"):
        load(path, state)


def test_sharded_index_slices_are_checked(tmp_path):
    # A sharded leaf: the params of a dp2-free layout are whole, so build the record by hand
    # from a replicated one (one shard covering the whole leaf), then push it out of range.
    state = _state()
    path = save(state, tmp_path / "ck")

    def shard(index, start):
        rec = index["leaves"]["params.weight"]
        rec.update(kind="sharded", spec=[[], []], blocks=[1, 1],
                   shards=[{"file": rec.pop("file"), "slice": [[start, 3], [0, 4]]}])

    _rewrite_index(path, lambda ix: shard(ix, 0))
    assert torch.equal(load(path, state).params["weight"], state.params["weight"])
    path = save(state, tmp_path / "ck")
    _rewrite_index(path, lambda ix: shard(ix, 1))
    with pytest.raises(CheckpointError, match=r"'params.weight' has shard slice \[\[1, 3\], "
                                              r"\[0, 4\]\], not 2 \[start, length\] pairs"):
        load(path, state)


def test_resume_by_directory_warns_and_a_save_replaces_the_damaged_one(tmp_path):
    # The repro: the newest checkpoint's index deleted; resume by directory falls back
    # to the previous one, says so naming it, and training on saves that step again.
    for s in (3, 6):
        save(_state(seed=s, step=s), tmp_path / f"step_{s:08d}")
    newest = str(tmp_path / "step_00000006")
    os.remove(os.path.join(newest, "index.json"))
    with pytest.warns(UserWarning, match=r"skipping .*step_00000006, which is not a complete "
                                          r"checkpoint: .*but no index\.json"):
        found = latest_checkpoint(tmp_path)
    assert found == str(tmp_path / "step_00000003")
    again = _state(seed=9, step=6)
    save(again, newest)
    assert latest_checkpoint(tmp_path) == newest
    assert torch.equal(load(newest, _state()).params["weight"], again.params["weight"])
    # A missing rank file is found without hashing anything, and warned about too.
    os.remove(os.path.join(newest, "rank00000.safetensors"))
    with pytest.warns(UserWarning, match=r"step_00000006.*rank00000.safetensors is missing"):
        assert latest_checkpoint(tmp_path) == str(tmp_path / "step_00000003")
    # Directories that hold no checkpoint file are not checkpoints: no warning.
    os.makedirs(tmp_path / "logs")
    save(again, newest)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert latest_checkpoint(tmp_path) == newest


def test_save_refuses_to_replace_a_foreign_directory(tmp_path):
    mine = tmp_path / "notes"
    os.makedirs(mine)
    (mine / "todo.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"not a funcpar checkpoint \(it holds \['todo.txt'\]"):
        save(_state(), mine)
    assert (mine / "todo.txt").read_text() == "keep me"
