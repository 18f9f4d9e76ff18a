"""Module-level task functions the cluster tests send to the ranks (they travel by name)."""

import os
import time

import torch

from patchray.distributed import comm


def whoami(ctx):
    return {"rank": ctx.rank, "world_size": ctx.world_size, "pid": os.getpid(), "device": str(ctx.device), "backend": ctx.backend}


def all_reduce_random(ctx, seed):
    g = torch.Generator().manual_seed(seed + ctx.rank)
    x = torch.randn(5, 7, generator=g, dtype=torch.float64)
    local = x.clone()
    comm.all_reduce(x, ctx)
    return local, x


def neighbour_exchange(ctx, rows_per_rank, halos):
    g = torch.Generator().manual_seed(100 + ctx.rank)
    band = torch.randn(rows_per_rank[ctx.rank], 4, generator=g)
    halo = comm.exchange_halo(band, ctx, 0, halos)
    return band, halo.before, halo.after


def known_sequence(ctx):
    """A fixed sequence of operations whose counts the test knows in advance."""
    with comm.log_comm() as log:
        t = torch.ones(8)  # 32 bytes
        comm.all_reduce(t, ctx)
        comm.all_reduce(t, ctx)
        comm.all_gather_padded(torch.ones(2, 3), ctx, 0, [2] * ctx.world_size)  # 24 bytes out, n*24 in (one flat all-gather)
        comm.exchange_halo(torch.ones(3, 2), ctx, 0, [(1, 1)] * ctx.world_size)  # 8 bytes each way
        comm.broadcast(torch.ones(4), ctx)
    return log.to_dict()


def die_on(ctx, rank_to_die):
    if ctx.rank == rank_to_die:
        time.sleep(0.5)
        os._exit(3)
    t = torch.ones(1)
    comm.all_reduce(t, ctx)  # the others block here until the cluster is stopped
    return t.item()


def hang_on(ctx, rank_to_hang):
    if ctx.rank == rank_to_hang:
        time.sleep(3600)
    t = torch.ones(1)
    comm.all_reduce(t, ctx)
    return t.item()


def refuse(ctx, value):
    # validation from shared data: every rank raises the same error, nobody waits in a collective
    if value < 0:
        raise ValueError(f"value must be >= 0 (got {value}); pass a non-negative value")
    return value


def report_steps(ctx, n, pause_s):
    from patchray.distributed.cluster import report_progress

    for i in range(n):
        report_progress(i + 1, n)
        time.sleep(pause_s)
    return ctx.rank


def raise_while_peers_wait(ctx, failing_rank, delay_s):
    """``failing_rank`` raises a ValueError after ``delay_s`` while its peers block in a collective with it."""
    if ctx.rank == failing_rank:
        time.sleep(delay_s)
        raise ValueError(f"the real cause on rank {ctx.rank}: bad band height 7")
    t = torch.ones(1)
    comm.all_reduce(t, ctx)
    return t.item()


def peers_time_out_before_the_cause(ctx, failing_rank, delay_s):
    """The peers of ``failing_rank`` wait for it in a collective on a group with a 1 s timeout, so their (secondary)
    timeout errors reach the driver before ``failing_rank`` reports the root cause, ``delay_s`` later."""
    import datetime

    import torch.distributed as dist  # a group with its own short timeout: test scaffolding, not library code

    group = dist.new_group(list(range(ctx.world_size)), timeout=datetime.timedelta(seconds=1))
    if ctx.rank == failing_rank:
        time.sleep(delay_s)
        raise ValueError("the root cause: latent height 7 is not divisible by 2")
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return t.item()


def cache_put(ctx, key, numel):
    """Cache a tensor on the rank as a model would be cached; returns the cache's size."""
    from patchray.distributed.cluster import rank_cache

    rank_cache()[key] = torch.ones(numel)
    return len(rank_cache())


def cache_len(ctx):
    from patchray.distributed.cluster import rank_cache

    return len(rank_cache())


class ExpectedMiss(RuntimeError):
    """An error its caller expects and recovers from (as the VAE ranks' missing-weights signal is)."""

    patchray_expected = True


def labelled_failure(ctx, failing_rank, expected):
    """``failing_rank`` raises (an :class:`ExpectedMiss` when ``expected``, else a RuntimeError); the others return."""
    if ctx.rank == failing_rank:
        raise (ExpectedMiss if expected else RuntimeError)(f"no cached weights on rank {ctx.rank}")
    return ctx.rank


labelled_failure.patchray_task = "doing the labelled work"
