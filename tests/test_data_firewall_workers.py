"""``Firewall.collate_fn`` in real torch DataLoader workers with ``quarantine_dir``: every
worker process writes files of its own (before, two workers numbered their batches alike and
overwrote each other's ``{prefix}-e0000-b00000N.npz``: 2 files for 8 flagged samples)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from numstab.data import Firewall

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

BAD = (1, 5, 9, 13)  # one non-finite sample in each batch of 4


class _Samples(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        x = torch.full((3,), float(i))
        if i in BAD:
            x[0] = float("nan")
        return x, i


def _records(directory) -> list[tuple[str, int, int]]:
    """(file, index, dataset id) per quarantined sample."""
    out = []
    for name in sorted(os.listdir(directory)):
        with np.load(os.path.join(directory, name), allow_pickle=False) as f:
            paths = list(f["paths"])
            ids = f[f"field_{paths.index('[1]')}"]
            out += [(name, int(k), int(i)) for k, i in zip(f["index"], ids, strict=True)]
    return out


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_write_one_file_per_flagged_batch_and_never_overwrite(tmp_path, persistent):
    fw = Firewall("drop", quarantine_dir=tmp_path)
    loader = DataLoader(
        _Samples(),
        batch_size=4,
        num_workers=2,
        persistent_workers=persistent,
        collate_fn=fw.collate_fn(),
    )
    for _ in range(2):  # two epochs
        seen = sorted(i for _, ids in loader for i in ids.tolist())
        assert seen == sorted(set(range(16)) - set(BAD))  # dropped in the workers
    records = _records(tmp_path)
    assert len(records) == 8 and len({name for name, _, _ in records}) == 8
    assert sorted(i for _, _, i in records) == sorted(BAD * 2)  # the id field is exact
    for name, index, _ in records:
        assert "-w0" in name and f"-p{os.getpid()}-" not in name  # a worker's tag
        assert 0 <= index < 16  # a position in that worker copy's stream
    assert fw.stats.samples_seen == 0  # the main process's copy saw nothing
