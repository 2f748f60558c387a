"""Client and AsyncClient expose the same API, and the base install stays light."""

import inspect
import subprocess
import sys

from icefloe.client import AsyncClient, Client


def _public_methods(cls) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_")
    }


def test_sync_and_async_clients_have_the_same_methods_and_parameters():
    sync_methods, async_methods = _public_methods(Client), _public_methods(AsyncClient)
    assert sorted(sync_methods) == sorted(async_methods)
    for name, signature in sync_methods.items():
        assert list(signature.parameters) == list(async_methods[name].parameters), name
        method = getattr(AsyncClient, name)
        returns_future = str(async_methods[name].return_annotation).startswith("asyncio.Future")
        awaitable = inspect.iscoroutinefunction(method) or returns_future
        assert awaitable or name in {"from_handle", "handle"}, f"AsyncClient.{name} must be awaitable"


def test_client_signatures_pinned_for_integrations():
    """verl and SkyRL call these names and keywords; renaming them breaks those integrations."""
    expected = {
        "fwd_bwd": ["self", "batch", "processing"],
        "fwd_no_grad": ["self", "batch", "reference_model"],
        "forward": ["self", "batch", "reference"],
        "step": ["self", "learning_rate"],
        "generate": ["self", "prompts", "sampling_params"],
        "sync_weights": ["self", "cuda_ipc", "low_memory", "weight_format"],
        "save_checkpoint": ["self", "kind"],
        "load_checkpoint": ["self", "checkpoint_id", "source_job_id"],
        "sleep_inference": ["self", "level"],
        "wake_inference": ["self", "tags"],
        "shutdown": ["self"],
    }
    methods = _public_methods(Client)
    for name, params in expected.items():
        assert list(methods[name].parameters) == params, name


def test_remote_client_import_stays_light():
    code = (
        "import sys\n"
        "from icefloe.client import Client\n"
        "from icefloe.config import ClientConfig\n"
        "client = Client(ClientConfig.build(backend={'type': 'remote', 'base_url': 'http://127.0.0.1:9'}))\n"
        "assert not client.closed\n"
        "client.shutdown()  # never opened: no I/O, nothing to cancel\n"
        "for heavy in ('icefloe.engines', 'ray', 'vllm', 'transformers', 'fastapi'):\n"
        "    assert heavy not in sys.modules, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
