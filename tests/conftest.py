import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several pytest-xdist workers share the cores: one OpenMP thread per process (this one and the servers
    # it starts), or their spinning threads slow each other down more than the parallel run gains.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)

import pathlib

import pytest

DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def golden_path() -> pathlib.Path:
    return DATA / "ttnn_tiles.npz"
