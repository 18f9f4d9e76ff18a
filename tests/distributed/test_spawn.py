"""distributed/spawn.py: the ranks meet through a FileStore in a private folder that is gone afterwards."""

import os
import tempfile

import pytest

from patchray.distributed.spawn import RankError, run_ranks


def _store_kinds(ctx):
    # the store the default process group was formed with, unwrapped from torch's prefix stores
    from torch.distributed import distributed_c10d

    kinds, store = [], distributed_c10d._get_default_store()
    while store is not None:
        kinds.append(type(store).__name__)
        store = getattr(store, "underlying_store", None)
    return ctx.rank, kinds


def _fail_on_rank_1(ctx):
    if ctx.rank == 1:
        raise ValueError("rank one refuses")
    return ctx.rank


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    # run_ranks makes its rendezvous folder with tempfile: point tempfile at an empty folder of our own
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_ranks_rendezvous_through_a_file_store_that_is_removed(private_tmp):
    results = run_ranks(_store_kinds, 2, timeout_s=60)
    assert [r for r, _ in results] == [0, 1]
    for _, kinds in results:
        assert "FileStore" in kinds and "TCPStore" not in kinds, kinds
    assert os.listdir(private_tmp) == []  # the rendezvous folder went with the ranks


def test_a_failing_rank_is_named_and_the_folder_still_removed(private_tmp):
    with pytest.raises(RankError, match=r"rank 1 failed: ValueError: rank one refuses"):
        run_ranks(_fail_on_rank_1, 2, timeout_s=60)
    assert os.listdir(private_tmp) == []


def test_the_backend_is_nccl_only_with_a_gpu_per_rank_and_a_bad_choice_is_refused_first():
    from patchray.distributed.spawn import choose_backend

    assert choose_backend("auto", "cuda", 2, gpus=2) == "nccl"
    assert choose_backend("auto", "cuda", 2, gpus=1) == "gloo"  # ranks share the GPU: NCCL would refuse them
    assert choose_backend("auto", "cpu", 4) == "gloo"
    assert choose_backend("gloo", "cuda", 4, gpus=8) == "gloo"
    with pytest.raises(ValueError, match="needs a GPU per rank: 2 ranks, 1 GPU"):
        choose_backend("nccl", "cuda", 2, gpus=1)
    with pytest.raises(ValueError, match="CUDA ranks only"):
        choose_backend("nccl", "cpu", 2)
    with pytest.raises(ValueError, match="--backend must be"):
        choose_backend("mpi", "cuda", 2, gpus=2)
