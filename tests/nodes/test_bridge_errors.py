"""What the user reads when a rank fails (nodes/bridge/errors.py), on error texts produced by real Ray."""

import pytest

from patchray.distributed.cluster import ClusterConfig, RankFailure, get_cluster
from patchray.nodes.bridge.errors import for_user, rank_errors_for_user, user_message

pytestmark = pytest.mark.usefixtures("ray_session")

_RAY_MARKS = ("\x1b[", "ray::", "pid=", "actor_id", "RayTaskError", "Traceback", 'File "')


@pytest.fixture(scope="module")
def cluster():
    return get_cluster(ClusterConfig(num_ranks=2, device="cpu"))


def _ray_task_error(exc):
    """The exception Ray itself hands the driver for ``exc`` raised in a task (no PatchRay code in between)."""
    import ray

    @ray.remote(num_cpus=0.01)
    def fails():
        raise exc

    with pytest.raises(Exception) as info:
        ray.get(fails.remote())
    return info.value


def test_a_ray_wrapped_value_error_becomes_its_own_message(cluster):
    wrapped = _ray_task_error(ValueError("latent has 7 channels but this kl VAE expects 4"))
    text = str(wrapped)
    assert type(wrapped).__name__ == "RayTaskError(ValueError)" and "ray::" in text
    assert "\x1b[" in text or "pid=" in text  # Ray's decoration is really there to strip
    assert user_message(wrapped) == "latent has 7 channels but this kl VAE expects 4"
    clean = for_user(wrapped)
    assert type(clean) is ValueError and str(clean) == "latent has 7 channels but this kl VAE expects 4"


def test_a_rank_failure_keeps_the_rank_and_the_original_type(cluster):
    def boom(ctx):
        if ctx.rank == 1:
            raise RuntimeError("out of cheese")
        return ctx.rank

    with pytest.raises(Exception) as info:
        cluster.run(boom)  # a real rank raising through the real cluster
    clean = for_user(info.value)
    message = str(clean)
    assert isinstance(clean, RankFailure) and clean.ranks == info.value.ranks
    assert "rank 1" in message and "RuntimeError: out of cheese" in message
    assert not any(mark in message for mark in _RAY_MARKS), message


def test_a_rank_failure_built_from_ray_text_is_cleaned(cluster):
    # the form the cluster has used: its own context, then Ray's whole text of the rank's exception
    cause = _ray_task_error(RuntimeError("boom on 1"))
    failure = RankFailure(f"rank 1 raised while calling boom: {type(cause).__name__}: {cause}", [1], cause)
    assert user_message(failure) == "rank 1 raised while calling boom: RuntimeError: boom on 1"


def test_the_context_manager_chains_the_original_and_leaves_other_errors_alone(cluster):
    def refuse(ctx):
        raise ValueError("rows do not fit")

    with pytest.raises(ValueError) as info:
        with rank_errors_for_user():
            cluster.run(refuse)
    assert str(info.value) == "rows do not fit" and type(info.value) is ValueError
    # the rank's full trace stays with the exception (and the cluster logs it), only the message is shown plainly
    assert 'raise ValueError("rows do not fit")' in info.value.trace and info.value.rank in (0, 1)

    class Interrupted(Exception):  # e.g. ComfyUI's InterruptProcessingException: must reach ComfyUI unchanged
        pass

    original = Interrupted()
    with pytest.raises(Interrupted) as info:
        with rank_errors_for_user():
            raise original
    assert info.value is original


@pytest.mark.parametrize(
    "raw, clean",
    [
        # Ray's text for a rank process that died: its ids and process fields are not the user's business
        ("The actor died unexpectedly before finishing this task. class_name: _RankActor actor_id: 58b3a9f1e2d4c6b8a0f1e2d3c4b5a6f7 "
         "pid: 1234 namespace: patchray", "The actor died unexpectedly before finishing this task."),
        ("rank 1 raised ActorID(58b3a9f1e2d4c6b8a0f1) ValueError: bad", "rank 1 raised ValueError: bad"),
        # the temporary folders the ranks import the pack from read as the pack's own paths
        ("ImportError: cannot import name 'x' from /tmp/patchray-import-0/patchray/nodes/bridge/ksampler_rank.py",
         "ImportError: cannot import name 'x' from patchray/nodes/bridge/ksampler_rank.py"),
        ("in /tmp/ray/session_2026-12-01_10-00-00_123_45/runtime_resources/py_modules_files/ab12/patchray/distributed/x.py",
         "in patchray/distributed/x.py"),
        # the user's own paths stay
        ("ValueError: no file /home/u/ComfyUI/models/vae/x.safetensors", "ValueError: no file /home/u/ComfyUI/models/vae/x.safetensors"),
    ],
)
def test_ray_ids_and_temporary_import_paths_are_removed(raw, clean):
    from patchray.nodes.bridge.errors import _clean_text

    assert _clean_text("\x1b[31m" + raw + "\x1b[0m") == clean


def test_models_are_named_by_comfyuis_family_not_the_network_class():
    from patchray.nodes.bridge.errors import model_name

    class SD3:  # ComfyUI's supported-model classes carry the names users know (comfy/supported_models.py)
        pass

    class OpenAISignatureMMDITWrapper:
        pass

    model = type("ModelPatcher", (), {})()
    model.model = type("BaseModel", (), {})()
    model.model.diffusion_model = OpenAISignatureMMDITWrapper()
    assert model_name(model) == "OpenAISignatureMMDITWrapper"  # no family known: the network, as a last resort
    model.model.model_config = SD3()
    assert model_name(model) == "SD3"
