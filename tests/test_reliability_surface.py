"""Reliability, round 4 (issue 38): the surface added in the last round, probed the way
careless users probe it. Records through every data-moving collective, Python objects of
the user's script through the object collectives and fused structures, ``scan`` with
``maxloc``, broadcast arrays nested in lists and dicts read-only as top-level ones, and the
objects a GPU rank refuses; each against numpy, on CPU ranks and simulated GPUs."""

import numpy as np
import pytest
from conftest import PEER_LAYOUTS, layout_group

import synk

RECORD = np.dtype([("id", "<i4"), ("score", "<f8"), ("tag", "S3")])


@pytest.fixture(params=list(PEER_LAYOUTS))
def group(request, monkeypatch):
    with layout_group(monkeypatch, *PEER_LAYOUTS[request.param]) as n:
        yield n


def _records(r: int, rows: int) -> np.ndarray:
    out = np.zeros(rows, RECORD)
    out["id"] = np.arange(rows) + 100 * r
    out["score"] = np.arange(rows) / (r + 1)
    out["tag"] = f"r{r}".encode()
    return out


# -- item 6: records in gather/igather and alltoall/ialltoall --------------------------------
def _move_records(marker):
    r, n = synk.comm.rank(), synk.comm.size()
    mine = _records(r, r + 1)  # lengths differ between ranks
    return {
        "gather": synk.comm.gather(mine, root=n - 1),
        "igather": synk.comm.igather(mine, root=0).wait(),
        "alltoall list": synk.comm.alltoall([_records(r, p + 1) for p in range(n)]),
        "ialltoall list": synk.comm.ialltoall([_records(r, p) for p in range(n)]).wait(),
        "alltoall": synk.comm.alltoall(_records(r, 2 * n), counts=[2] * n),
        "ialltoall": synk.comm.ialltoall(_records(r, n)).wait(),
        "scatter": synk.comm.scatter([_records(r, p + 1) for p in range(n)] if r == 1
                                     else None, root=1),
    }


def test_records_travel_through_gather_and_alltoall(group):
    n = group
    got = synk.function(_move_records, bcast_inputs=["marker"], reduce=None,
                        timeout=60)(np.zeros(1))
    joined = np.concatenate([_records(q, q + 1) for q in range(n)])
    for r, out in enumerate(got):
        for name in ("gather", "igather"):
            root = n - 1 if name == "gather" else 0
            if r == root:
                assert out[name].dtype == RECORD, name
                np.testing.assert_array_equal(out[name], joined)
            else:
                assert out[name] is None
        for name, want in [
                ("alltoall list", [_records(q, r + 1) for q in range(n)]),
                ("ialltoall list", [_records(q, r) for q in range(n)])]:
            assert [p.dtype for p in out[name]] == [RECORD] * n
            for part, expected in zip(out[name], want):
                np.testing.assert_array_equal(part, expected)
        rows = np.concatenate([_records(q, 2 * n)[2 * r:2 * r + 2] for q in range(n)])
        np.testing.assert_array_equal(out["alltoall"], rows)
        assert out["alltoall"].dtype == RECORD
        rows = np.concatenate([_records(q, n)[r:r + 1] for q in range(n)])
        np.testing.assert_array_equal(out["ialltoall"], rows)
        assert out["scatter"].dtype == RECORD
        np.testing.assert_array_equal(out["scatter"], _records(1, r + 1))
