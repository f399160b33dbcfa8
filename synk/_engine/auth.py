"""Mutual challenge-response on a control channel, before either side unpickles anything: each
side proves it holds the group's key by returning the HMAC-SHA256 of a fresh random nonce
from the other (the scheme of ``multiprocessing.connection``'s authkey, with a bounded
wait)."""
from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable
from multiprocessing import AuthenticationError

KEY_BYTES = 32
MAX_MESSAGE = 256  # no authentication message is longer; refuse bigger ones unread
_CHALLENGE = b"#SYNK-CHALLENGE#"
_WELCOME = b"#SYNK-WELCOME#"
_FAILURE = b"#SYNK-FAILURE#"


def new_key() -> bytes:
    """A group's random key. The master hands it to a worker through the worker's watch pipe (under
    MPI: over MPI), never through argv or the environment, which other processes can read."""
    return secrets.token_bytes(KEY_BYTES)


def _digest(key: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, nonce, "sha256").digest()


def challenge(send: Callable[[bytes], None], recv: Callable[[], bytes], key: bytes) -> None:
    """Check that the peer holds ``key``; raises AuthenticationError if it does not."""
    nonce = secrets.token_bytes(32)
    send(_CHALLENGE + nonce)
    if hmac.compare_digest(recv(), _digest(key, nonce)):
        send(_WELCOME)
        return
    send(_FAILURE)
    raise AuthenticationError("the peer answered the challenge without this group's key")


def answer(send: Callable[[bytes], None], recv: Callable[[], bytes], key: bytes) -> None:
    """Prove to the peer that this process holds ``key``."""
    message = recv()
    if not message.startswith(_CHALLENGE):
        raise AuthenticationError("the peer sent something other than an authentication challenge")
    send(_digest(key, message[len(_CHALLENGE):]))
    if recv() != _WELCOME:
        raise AuthenticationError("the peer rejected this process's key")


def handshake(send, recv, key: bytes, *, first: bool) -> None:
    """Both directions: the side with ``first`` challenges first, the other answers first."""
    for step in (challenge, answer) if first else (answer, challenge):
        step(send, recv, key)
