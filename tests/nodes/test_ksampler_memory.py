"""The Distributed KSampler refuses, before anything ships, a size whose smallest model call on a rank ComfyUI itself
estimates larger than the memory that rank can use (pure arithmetic on the layout: no ComfyUI, no ranks)."""

import pytest

from patchray.nodes.bridge.dit_layout import plan_layout
from patchray.nodes.bridge.parallel_model import check_call_memory, rank_call_shape

GIB = 1024**3


class _Model:
    """A MODEL-like object: ``.model.memory_required`` is ComfyUI's CPU formula (0.15 MiB per latent pixel per row)."""

    class _Base:
        def memory_required(self, shape, cond_shapes={}):
            area = shape[0]
            for d in shape[2:]:
                area *= d
            return area * 0.15 * 2**20

    model = _Base()


def test_each_layout_s_smallest_call():
    seq = plan_layout("sequence", 3, 5.0, 1)
    assert rank_call_shape((1, 4, 25, 40), seq) == (1, 4, 9, 40)  # a band: ceil(25 / 3) rows
    batch = plan_layout("batch", 2, 5.0, 5)
    assert rank_call_shape((5, 16, 3, 20, 30), batch) == (3, 16, 3, 20, 30)  # ceil(5 / 2) rows of the batch
    cfg = plan_layout("cfg", 2, 5.0, 2)
    assert rank_call_shape((2, 4, 64, 64), cfg) == (2, 4, 64, 64)  # whole latents, one conditioning at a time


def test_cpu_ranks_share_the_host_and_a_fitting_size_passes():
    layout = plan_layout("sequence", 2, 5.0, 1)
    # 2048 x 2048 latent: a band of 1024 x 2048 rows -> 307.2 GiB by ComfyUI's estimate; 16 GiB shared by 2 ranks
    mem = [(16 * GIB, 24 * GIB, "cpu")] * 2
    with pytest.raises(ValueError) as exc:
        check_call_memory(_Model(), (1, 4, 2048, 2048), layout, mem)
    text = str(exc.value)
    assert text.startswith("latent_image: ") and "307.2 GiB" in text and "8.0 GiB" in text and "2 CPU ranks" in text
    assert "Lower width and height about 6.2x" in text
    check_call_memory(_Model(), (1, 4, 128, 128), layout, mem)  # 1.2 GiB per rank: runs


def test_gpu_ranks_are_judged_by_their_card_and_batch_is_named():
    layout = plan_layout("batch", 2, 5.0, 8)
    mem = [(2 * GIB, 24 * GIB, "cuda"), (20 * GIB, 80 * GIB, "cuda")]
    with pytest.raises(ValueError) as exc:
        check_call_memory(_Model(), (8, 4, 256, 256), layout, mem)  # 4 rows x 65536 px -> 38.4 GiB > the 24 GiB card
    assert "smallest rank's card" in str(exc.value) and "batch_size (each rank's calls hold 4 of the batch's 8 rows)" in str(exc.value)
    check_call_memory(_Model(), (8, 4, 128, 128), layout, mem)  # 9.6 GiB: fits the card although only 2 GiB are free now


def test_a_model_without_an_estimate_is_not_refused():
    class NoEstimate:
        model = object()

    check_call_memory(NoEstimate(), (1, 4, 4096, 4096), plan_layout("sequence", 2, 5.0, 1), [(GIB, GIB, "cpu")] * 2)
