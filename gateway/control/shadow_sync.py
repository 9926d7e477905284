"""The shadow runs' configuration, one for every gateway replica: kept in the state store (with Redis, shared),
so each replica mirrors the same share to the same candidate under the same cap and gates.

The store holds one document (`shadow`/`configs`: {model: ShadowConfig.to_dict()}). A replica's admin API
writes it (`publish`, then applies the change at once); every replica reads it once a second (`run`) and installs
what changed in its own ShadowLedger (gateway/control/shadow.py), whose books then start afresh for that model.
The gateway config's `shadow:` section (per model, the admin API's body) seeds the document when the store has
none yet: the first replica up writes it, the others (and restarts) take what the store holds, so a change made
through the admin API outlives a replica's restart. Each replica keeps its own figures and judges its own gates
on them; the configuration is what they share.
"""

from __future__ import annotations

import logging

from gateway.control.shadow import ShadowConfig, ShadowError, ShadowLedger
from gateway.control.state import StateUnavailable
from gateway.ticks import sleep_to_tick

KIND, DOC_ID = "shadow", "configs"
TTL_S = 10 * 365 * 86400.0  # the store's documents expire; this one should not
log = logging.getLogger(__name__)


class ShadowSync:
    def __init__(self, ledger: ShadowLedger, state, configured: dict[str, dict] | None = None,
                 interval_s: float = 1.0) -> None:
        self.ledger = ledger
        self.state = state
        self.configured = dict(configured or {})  # the gateway config's `shadow:` section, already validated
        self.interval_s = interval_s

    async def _read(self) -> dict[str, dict] | None:
        doc = await self.state.get_document(KIND, DOC_ID)
        return None if doc is None else dict(doc.get("models") or {})

    def _apply(self, wanted: dict[str, dict]) -> None:
        """Install every config of `wanted` that differs from the ledger's, remove the ones it lacks."""
        for model in [m for m in self.ledger.configs if m not in wanted]:
            self.ledger.set_config(None, model)
        for model, raw in wanted.items():
            current = self.ledger.configs.get(model)
            if current is not None and current.to_dict() == raw:
                continue
            try:
                self.ledger.set_config(ShadowConfig.from_dict(model, raw, self.ledger.max_window_s))
            except ShadowError as e:  # written by a replica of another version: keep what runs
                log.warning("shadow config of %s in the state store is refused here: %s", model, e)

    async def start(self) -> None:
        """Take the store's configs, or write the gateway config's when the store has none."""
        try:
            wanted = await self._read()
            if wanted is None:
                wanted = self.configured
                if wanted:
                    await self.state.put_document(KIND, DOC_ID, {"models": wanted}, TTL_S)
        except StateUnavailable as e:  # the store down at start: run the config's own until it answers
            log.warning("shadow configs: state store unavailable at start (%s); using the config's", e)
            wanted = self.configured
        self._apply(wanted)

    async def publish(self, model: str, config: ShadowConfig | None) -> None:
        """The admin API's change: into the store for every replica, and into this one's ledger now."""
        wanted = await self._read() or {}
        if config is None:
            wanted.pop(model, None)
        else:
            wanted[model] = config.to_dict()
        await self.state.put_document(KIND, DOC_ID, {"models": wanted}, TTL_S)
        self.ledger.set_config(config, model)

    async def run(self) -> None:
        while True:
            await sleep_to_tick(self.interval_s)
            try:
                wanted = await self._read()
            except StateUnavailable as e:  # the store is down: keep what runs, try again
                log.debug("shadow configs: state store unavailable (%s)", e)
                continue
            if wanted is not None:
                self._apply(wanted)
