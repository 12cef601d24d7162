"""pipeline.data.store: feature codec, atomic parts and manifest, capture keys, resume bookkeeping, readers."""

import json

import numpy as np
import pytest
import torch

from pipeline.data import store as st
from pipeline.data.integrity import verify_store

H = 16


def rows(lengths, dtype="bf16", seed=0):
    """Columns of a part with random features; also returns the features themselves."""
    gen = torch.Generator().manual_seed(seed)
    feats = [torch.randn(n, H, generator=gen) * 3 for n in lengths]
    encoded = [st.encode_hidden(f, dtype) for f in feats]
    cols = {
        "sample_id": [f"s{seed}-{i}" for i in range(len(lengths))],
        "input_ids": [np.arange(n, dtype=np.int32) + i for i, n in enumerate(lengths)],
        "loss_mask": [(np.arange(n) % 2).astype(np.uint8) for n in lengths],
        "hidden": [e[0] for e in encoded],
        "scales": [e[1] for e in encoded],
    }
    return cols, feats


def make_store(path, parts=((3, 5, 2), (7, 1)), dtype="bf16", complete=True):
    manifest, _ = st.open_for_writing(str(path), {"target_id": "t", "dtype": dtype}, {"cfg": 1})
    for seed, lengths in enumerate(parts):
        table = st.part_table(rows(lengths, dtype, seed)[0], dtype, H)
        manifest["files"].append(st.write_part(str(path), f"part-test-{seed:05d}.parquet", table))
    manifest["complete"] = complete
    st.write_manifest(str(path), manifest)
    return manifest


def test_bf16_round_trip_is_a_view_on_the_buffer(tmp_path):
    """Rows read back hold the exact bf16 features, viewed in place on the Arrow buffer."""
    make_store(tmp_path)
    (row, *_) = st.iter_rows(st.part_files(str(tmp_path)))
    decoded = st.decode_row(row, H)
    assert torch.equal(decoded["hidden"], rows((3, 5, 2))[1][0].bfloat16())
    assert decoded["hidden"].data_ptr() == row["hidden"].address  # no copy
    assert decoded["input_ids"].tolist() == [0, 1, 2] and decoded["loss_mask"].tolist() == [0, 1, 0]


def test_fp8_option_halves_bytes_with_small_error():
    feats = torch.randn(50, H) * torch.logspace(-2, 2, 50)[:, None]  # per-token scales matter
    data, scales = st.encode_hidden(feats, "fp8")
    assert len(data) == 50 * H and scales.dtype == np.float32
    back = st.decode_row({"hidden": data, "scales": scales, "input_ids": np.zeros(50), "loss_mask": np.zeros(50)}, H)
    error = (back["hidden"].float() - feats).abs().amax(-1) / feats.abs().amax(-1)  # per token, relative to its max
    assert back["hidden"].dtype == torch.bfloat16 and error.max() < 0.07


def test_part_files_and_schema_metadata(tmp_path):
    import pyarrow.parquet as pq

    make_store(tmp_path)
    files = st.part_files(str(tmp_path))
    assert [f.rsplit("/", 1)[1] for f in files] == ["part-test-00000.parquet", "part-test-00001.parquet"]
    meta = pq.read_schema(files[0]).metadata
    assert meta[b"griffin.dtype"] == b"bf16" and meta[b"griffin.hidden_size"] == b"16"
    manifest = st.read_manifest(str(tmp_path))
    assert manifest["totals"]["rows"] == 5 and manifest["totals"]["tokens"] == 18


def test_missing_or_incomplete_manifest_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no feature store at .* run `griffin featurize"):
        st.read_manifest(str(tmp_path / "none"))
    make_store(tmp_path, complete=False)
    with pytest.raises(ValueError, match="incomplete .* resume"):
        st.part_files(str(tmp_path))


def test_capture_key_mismatch_names_the_fields(tmp_path):
    make_store(tmp_path)
    assert st.check_capture_key(str(tmp_path), {"target_id": "t"})["complete"]
    with pytest.raises(ValueError, match=r"target_id: store has 't', expected 'other'; max_len: store has None"):
        st.check_capture_key(str(tmp_path), {"target_id": "other"}, max_len=64)


def test_resume_adopts_finished_parts_and_drops_leftovers(tmp_path):
    """A killed run: one part renamed into place but never recorded, one half-written temp file."""
    make_store(tmp_path, parts=((3, 5),), complete=False)
    orphan = st.part_table(rows((4,), seed=7)[0], "bf16", H)
    st.write_part(str(tmp_path), "part-killed-00000.parquet", orphan)
    (tmp_path / ".part-killed-00001.parquet.tmp-1234").write_bytes(b"PAR1 half")
    manifest, done = st.open_for_writing(str(tmp_path), {"target_id": "t", "dtype": "bf16"}, {"cfg": 2})
    assert done == {"s0-0", "s0-1", "s7-0"} and len(manifest["files"]) == 2
    assert not manifest["complete"] and manifest["config"] == {"cfg": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "_manifest.json",
        "part-killed-00000.parquet",
        "part-test-00000.parquet",
    ]
    with pytest.raises(ValueError, match="captured differently .*dtype: store has 'bf16', expected 'fp8'"):
        st.open_for_writing(str(tmp_path), {"target_id": "t", "dtype": "fp8"}, {})


def test_verify_reports_corruption_by_file(tmp_path):
    make_store(tmp_path)
    assert verify_store(str(tmp_path)) == []
    part = tmp_path / "part-test-00001.parquet"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    (problem,) = verify_store(str(tmp_path))
    assert problem.startswith("part-test-00001.parquet: sha256 is") and "corrupted" in problem


def test_pad_batches_respects_the_token_budget(tmp_path):
    make_store(tmp_path, parts=((3, 5, 2), (7, 1)), dtype="fp8")
    batches = list(st.pad_batches(st.iter_rows(st.part_files(str(tmp_path))), batch_tokens=10, hidden_size=H))
    # lengths 3, 5 | 2 | 7 | 1: adding the next row would exceed 10 padded tokens
    assert [b["sample_ids"] for b in batches] == [["s0-0", "s0-1"], ["s0-2"], ["s1-0"], ["s1-1"]]
    for batch in batches:
        b, t = batch["input_ids"].shape
        assert b * t <= 10
        assert batch["features"].shape == (b, t, H) and batch["features"].dtype == torch.bfloat16
        lengths = batch["attention_mask"].sum(1)
        for i, n in enumerate(lengths.tolist()):  # right padding is zero everywhere
            assert batch["features"][i, n:].abs().sum() == 0 and batch["loss_mask"][i, n:].sum() == 0
    assert sum(len(b["sample_ids"]) for b in batches) == 5


def test_store_iterable_splits_files_across_ranks(tmp_path):
    from pipeline.train.batches import StoreIterable

    make_store(tmp_path)
    files = st.part_files(str(tmp_path))
    seen = [
        sid
        for rank in range(2)
        for batch in StoreIterable(files, 64, H, rank=rank, world_size=2)
        for sid in batch["sample_ids"]
    ]
    assert sorted(seen) == ["s0-0", "s0-1", "s0-2", "s1-0", "s1-1"]
    loader = torch.utils.data.DataLoader(StoreIterable(files, 64, H), batch_size=None)
    assert [tuple(b["input_ids"].shape) for b in loader] == [(5, 7)]  # rows of both files, one budget
    assert json.loads((tmp_path / "_manifest.json").read_text())["totals"]["files"] == 2


def test_part_names_are_content_keys_read_in_plan_order(tmp_path):
    """The same planned part is the same file; plan index 10 reads after 9 (numbers, not text), and parts
    named before content names existed read first."""
    from pipeline.data.part_files import next_index, part_name

    assert part_name(3, ["b", "a"]) == part_name(3, ["a", "b"]) != part_name(3, ["a", "c"])
    assert part_name(3, ["a"]).startswith("part-000003-") and part_name(3, ["a"]) != part_name(4, ["a"])
    manifest, _ = st.open_for_writing(str(tmp_path), {"target_id": "t", "dtype": "bf16"}, {})
    for index, name in [(0, part_name(1_000_000, ["x"])), (1, part_name(9, ["y"])), (2, "part-abcd1234-00000.parquet")]:
        table = st.part_table(rows((2,), seed=index)[0], "bf16", H)
        manifest["files"].append(st.write_part(str(tmp_path), name, table))
    st.write_manifest(str(tmp_path), {**manifest, "complete": True})
    order = [f.rsplit("/", 1)[1] for f in st.part_files(str(tmp_path))]
    assert order == ["part-abcd1234-00000.parquet", part_name(9, ["y"]), part_name(1_000_000, ["x"])]
    assert next_index(manifest["files"]) == 1_000_001


def test_resume_never_records_a_sample_twice(tmp_path):
    """Orphans that repeat recorded rows (a retry under the old names, a part of another plan): one
    holding only repeats is deleted, one holding some is rewritten with its new rows only."""
    make_store(tmp_path, parts=((3, 5),), complete=False)  # s0-0, s0-1
    recorded = tmp_path / "part-test-00000.parquet"
    (tmp_path / "part-retry-00000.parquet").write_bytes(recorded.read_bytes())  # the same rows, another name
    mixed = st.part_table(rows((3, 5), seed=0)[0], "bf16", H)  # s0-0 and s0-1 again, plus one new row
    extra = st.part_table(rows((4,), seed=7)[0], "bf16", H)
    import pyarrow as pa

    st.write_part(str(tmp_path), "part-zz-00000.parquet", pa.concat_tables([mixed, extra]))
    manifest, done = st.open_for_writing(str(tmp_path), {"target_id": "t", "dtype": "bf16"}, {})
    assert done == {"s0-0", "s0-1", "s7-0"}
    names = sorted(p.name for p in tmp_path.glob("part-*"))
    assert names == sorted(f["file"] for f in manifest["files"]) and len(names) == 2
    assert "part-test-00000.parquet" in names and "part-retry-00000.parquet" not in names
    ids = [r["sample_id"] for r in st.iter_rows([str(tmp_path / n) for n in names])]
    assert sorted(ids) == ["s0-0", "s0-1", "s7-0"]


def test_a_repeated_part_is_refused_then_repaired(tmp_path):
    """A part recorded twice under two names: verify names it, training's check refuses the store with
    the repair command, and the repair leaves every sample once, the store still complete."""
    from pipeline.data.integrity import repair_store, require_unique_ids
    from pipeline.data.heldout import store_sample_ids

    manifest = make_store(tmp_path)
    copy = tmp_path / "part-test-00002.parquet"
    copy.write_bytes((tmp_path / "part-test-00000.parquet").read_bytes())
    manifest["files"].append({**manifest["files"][0], "file": copy.name})
    st.write_manifest(str(tmp_path), manifest)
    assert verify_store(str(tmp_path)) == [f"{copy.name}: 3 sample ids also in a part read before it (repeated rows)"]
    with pytest.raises(ValueError, match=r"3 sample ids in more than one row .* --verify .* --repair"):
        require_unique_ids(str(tmp_path), store_sample_ids(str(tmp_path)))
    assert repair_store(str(tmp_path)) == [f"{copy.name}: 3 of 3 rows repeat an earlier part; deleted"]
    assert verify_store(str(tmp_path)) == [] and not copy.exists()
    require_unique_ids(str(tmp_path), store_sample_ids(str(tmp_path)))
    assert st.read_manifest(str(tmp_path))["totals"]["rows"] == 5
