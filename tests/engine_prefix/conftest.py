import pytest

from duet.model_make import make_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("prefix_tiny"), preset="tiny")
