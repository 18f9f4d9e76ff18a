"""The ComfyUI wrappers the ranks install (nodes/bridge/ksampler_rank.py), driven the way ComfyUI drives them.

ComfyUI is not needed: the executors below do what ComfyUI's ``_calc_cond_batch`` and ``UNetModel.forward`` do with
what the wrappers hand them (the batching comparison, writing into ``transformer_options``).
"""

import math

import pytest
import torch

from patchray.nodes.bridge import ksampler_rank as kr


class _Model:
    """ComfyUI's BaseModel as far as the batching decision reads it."""

    def memory_required(self, input_shape, cond_shapes={}):  # noqa: B006 (ComfyUI's own signature)
        return 100.0 * input_shape[0]


class _Peers:
    """A rank session whose peers have ``peer_free`` bytes free (``agree_min`` is the group's minimum)."""

    def __init__(self, peer_free):
        self.peer_free = peer_free

    def agree_min(self, value):
        return min(value, self.peer_free)


def _comfy_batches(model, conds, x_in, local_free):
    # comfy.samplers._calc_cond_batch: cond and uncond share one call when this holds
    return model.memory_required([2 * x_in.shape[0]] + list(x_in.shape[1:]), cond_shapes={}) * 1.5 < local_free


@pytest.mark.parametrize("peer_free, batched", [(250.0, False), (10_000.0, True)])
def test_batching_follows_the_groups_minimum_free_memory(peer_free, batched):
    model, x = _Model(), torch.zeros(1, 4, 8, 8)
    wrapper = kr.agreed_batching(_Peers(peer_free), free_memory=lambda device: 1000.0)  # this rank: 1000 free
    # needs 200 * 1.5 = 300: fits this rank's 1000, not a peer's 250
    got = wrapper(lambda m, c, xi, *a, **k: _comfy_batches(m, c, xi, local_free=1000.0), model, [], x, torch.zeros(1), {})
    assert got is batched
    assert "memory_required" not in model.__dict__ and model.memory_required([1]) == 100.0  # restored


def test_the_model_is_restored_when_the_call_fails_and_nothing_else_is_replaced():
    model, x = _Model(), torch.zeros(1, 4, 8, 8)
    earlier = lambda input_shape, cond_shapes=None: 7.0  # an override another extension had set on the model
    model.memory_required = earlier
    wrapper = kr.agreed_batching(_Peers(10.0), free_memory=lambda device: 1000.0)

    def failing(m, *args, **kwargs):
        assert m.memory_required([2, 4, 8, 8]) == math.inf  # 7 * 1.5 does not fit the peer's 10 free
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        wrapper(failing, model, [], x, torch.zeros(1), {})
    assert model.memory_required is earlier


class _Executor:
    """ComfyUI's executor around ``UNetModel.forward``: it writes into the transformer_options it is given."""

    class_obj = object()

    def __init__(self):
        self.seen = []

    def __call__(self, x, t, transformer_options=None, **kwargs):
        self.seen.append(dict(transformer_options))
        transformer_options["original_shape"] = list(x.shape)
        return x


class _Session:
    def denoise(self, unet, fn, x, t, stream=None, **cond):
        return fn(x, t, **cond)


def test_calls_without_transformer_options_do_not_share_a_dict():
    wrapper, executor = kr.patch_parallel(_Session()), _Executor()
    wrapper(executor, torch.zeros(1, 4, 8, 8), torch.zeros(1))
    wrapper(executor, torch.zeros(1, 4, 16, 8), torch.zeros(1))
    assert executor.seen == [{}, {}]  # the first call's write did not leak into the second


def test_controlnet_is_refused_with_the_fix():
    with pytest.raises(NotImplementedError, match="is not supported yet; sample this graph without PatchRay"):
        kr.patch_parallel(_Session())(_Executor(), torch.zeros(1, 4, 8, 8), torch.zeros(1), control={"output": []})
