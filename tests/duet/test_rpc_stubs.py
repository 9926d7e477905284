"""The committed gRPC stubs must match proto/engine.proto."""

from pathlib import Path

from duet.rpc import regen


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    regen.generate(tmp_path)
    for name in regen.GENERATED:
        fresh = (tmp_path / name).read_text()
        committed = (regen.STUB_DIR / name).read_text()
        assert fresh == committed, f"duet/rpc/{name} is stale: run `make proto` and commit"
