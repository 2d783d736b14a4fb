import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")

import pathlib

import pytest

DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def golden_path() -> pathlib.Path:
    return DATA / "ttnn_tiles.npz"
