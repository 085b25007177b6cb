"""The options of ``nmt serve``, torch-free for the command line, valid from construction: a key
from NMT_API_KEY when --api-key is not given, and no address beyond loopback without a key."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field

from nmt.device_options import PANEL as DEVICE_PANEL
from nmt.device_options import InferenceDeviceOptions
from nmt.errors import NmtError
from nmt.options import check_values

API_KEY_ENV = "NMT_API_KEY"


@dataclass(frozen=True)
class ServeOptions:
    path: str = field(default="checkpoints/checkpoint_best.pt", metadata={"path": True,
        "help": "Checkpoint to serve; a.pt:b.pt serves an ensemble."})
    host: str = field(default="127.0.0.1", metadata={
        "help": "Address to bind; anything but loopback needs --api-key."})
    port: int = field(default=8080, metadata={"help": "Port to bind (0: a free one, logged).", "min": 0,
                                              "max": 65535})
    api_key: str | None = field(default=None, metadata={"literal": True,  # --api-key "" is no key, not "no option"
        "help": f"Require this key on every request (Authorization: Bearer KEY or X-API-Key); env {API_KEY_ENV}."})
    compute: InferenceDeviceOptions = field(default_factory=InferenceDeviceOptions, metadata={
        "help": "Device options.", "panel": DEVICE_PANEL})
    max_sentences: int = field(default=64, metadata={"help": "Sentences per request at most (413 beyond).",
                                                     "min": 1})
    max_characters: int = field(default=20_000, metadata={"help": "Characters per request at most (413 beyond).",
                                                          "min": 1})
    max_beam: int = field(default=16, metadata={"help": "Largest beam a request may ask for.", "min": 1})
    max_bans: int = field(default=64, metadata={"help": "Banned phrases per request at most (413 beyond).",
                                                "min": 0})
    max_constraints: int = field(default=8, metadata={
        "help": "Constraints per sentence at most (413 beyond).", "min": 0})
    max_phrase_pieces: int = field(default=16, metadata={
        "help": "Target pieces per banned phrase or constraint at most (422 beyond); a prefix may hold up to "
                "--max-output-length.", "min": 1})
    max_queue: int = field(default=1024, metadata={
        "help": "Sentences waiting or being translated at most; more answer 429.", "min": 1})
    batch_window_ms: float = field(default=5.0, metadata={
        "help": "How long the first request of a batch waits for others to join it.", "min": 0})
    max_output_length: int = field(default=256, metadata={
        "help": "Output tokens a sentence may reach at most (EOS excluded): max_len_a x its tokens + max_len_b, "
                "max_len_b, min_len and no_repeat_ngram_size above it answer 422.", "min": 1})
    max_batch_memory: int | None = field(default=None, metadata={
        "help": "MiB one batch's search may take at most, estimated from the model's shape: rows (sentences x "
                "beam) x the longest output each may reach, and the encoder's; a request that needs more gives "
                "its sentences over several batches, taking turns with the others. Unset: 1024, or what the "
                "heaviest sentence the limits allow needs if more.", "min": 1})
    request_timeout: float = field(default=60.0, metadata={
        "help": "Seconds a request may wait for its translation; later it answers 503.", "min": 0.001})
    body_timeout: float = field(default=10.0, metadata={
        "help": "Seconds a client may take to send a request body; later it answers 408.", "min": 0.001})
    max_connections: int = field(default=128, metadata={
        "help": "Requests handled at once at most (their bodies being read or their translations awaited); one "
                "more answers 503. Connections without a request count only against 4x this: beyond, a new "
                "one is closed at once.", "min": 1})
    idle_timeout: float = field(default=5.0, metadata={
        "help": "Seconds a connection may stay open without sending a whole request head (from its opening, and "
                "between requests); then it is closed.", "min": 0.001})

    def __post_init__(self) -> None:
        if self.api_key is None and API_KEY_ENV in os.environ:  # unlike a command line, other users cannot see it
            object.__setattr__(self, "api_key", os.environ[API_KEY_ENV])
        check_values(self)
        if self.api_key is not None and not self.api_key.strip():
            raise NmtError(f"the API key is empty (--api-key or {API_KEY_ENV}): give a key, or none")
        if self.max_queue < self.max_sentences:
            raise NmtError(f"--max-queue {self.max_queue} is below --max-sentences {self.max_sentences}: "
                           "a full request would always be refused (429)")
        if not is_loopback(self.host) and not self.api_key:
            raise NmtError(f"binding to {self.host} exposes the server beyond this machine: give --api-key KEY "
                           f"(or set {API_KEY_ENV})")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
