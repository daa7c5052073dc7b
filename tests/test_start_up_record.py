"""runner/start_up_record.py: the record that lets a start-up skip compile-ahead's queue pass and
the graph reserve's measurement when an earlier start-up of the same configuration left every
kernel in the cache and measured the reserve. Its name changes with
everything that decides the kernels (config, checkpoint config, place in the layout, sources); it
is written whole or not at all, inside Triton's cache folder."""

from __future__ import annotations

import pytest
import torch

from configs import EngineConfig
from runner import start_up_record

CPU = torch.device("cpu")


def _folder(tmp_path, text='{"model_type": "llama"}'):
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(text)
    return str(folder)


def test_the_key_is_stable_and_changes_with_what_decides_the_kernels(tmp_path):
    model = _folder(tmp_path)
    config = EngineConfig.from_kwargs(model=model, load_format="dummy")
    key = start_up_record.start_up_key(config, model, CPU, (0, 0, 4))
    assert key == start_up_record.start_up_key(EngineConfig.from_kwargs(model=model, load_format="dummy"), model,
                                               CPU, (0, 0, 4))
    others = {
        start_up_record.start_up_key(EngineConfig.from_kwargs(model=model, load_format="dummy", max_num_seqs=8),
                                     model, CPU, (0, 0, 4)),
        start_up_record.start_up_key(EngineConfig.from_kwargs(model=model, load_format="dummy", one_row_block_n=4),
                                     model, CPU, (0, 0, 4)),
        start_up_record.start_up_key(config, model, CPU, (1, 0, 4)),
        start_up_record.start_up_key(config, model, CPU, (0, 2, 4)),
    }
    _folder(tmp_path, '{"model_type": "llama", "hidden_size": 64}')
    others.add(start_up_record.start_up_key(config, model, CPU, (0, 0, 4)))
    assert key not in others and len(others) == 5


def test_a_record_is_written_whole_inside_tritons_cache_folder(tmp_path):
    cache = tmp_path / "cache"
    assert start_up_record.read(cache, "k1") is None
    start_up_record.record(cache, "k1", 100 << 20)
    start_up_record.record(cache, "k1", 94 << 20)   # again (another process): replaced, not an error
    assert start_up_record.read(cache, "k1") == start_up_record.StartUpRecord(graph_reserve_bytes=94 << 20)
    assert start_up_record.read(cache, "k2") is None
    folder = cache / "triton" / start_up_record.RECORDS
    assert [p.name for p in folder.iterdir()] == ["k1"]   # no temporary file left
    assert start_up_record.source_digest() in (folder / "k1").read_text()


@pytest.mark.parametrize("text", ["source abc\n", "{", "[]", '{"graph_reserve_bytes": "94"}',
                                  '{"graph_reserve_bytes": -1}', '{"graph_reserve_bytes": true}', ""])
def test_a_record_that_cannot_be_read_counts_as_none(tmp_path, text):
    """An older record's format or a broken file costs the start-up its shortcut, nothing more."""
    path = start_up_record.record_path(tmp_path, "k1")
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert start_up_record.read(tmp_path, "k1") is None
