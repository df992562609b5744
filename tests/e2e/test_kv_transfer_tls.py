"""The KV handoff's control connections over TLS, with real certificates (tests/tls_certs.py) on 127.0.0.1.

The receiver holds a cluster certificate and requires one from every peer (ServerTLS.ssl_context, what a decode
worker uses); a sender dials with its own (ServerTLS.member_client_context, what a prefill worker uses). A peer
without a cluster certificate, or speaking plaintext, is refused and counted before a single byte lands, and the
lease it aimed at still serves the real sender; a forged handle over a good connection is refused and counted
too.
"""

from __future__ import annotations

import secrets
import time

import pytest

from kv_transfer import FailureReason, KVReceiver, KVSender
from tandem_client.tls import ServerTLS
from tests.e2e.kv_tcp_peer import (
    FIRST,
    NUM_BLOCKS,
    ShuffledFreeList,
    checksum,
    config,
    make_cache,
    make_layout,
    wait_results,
)
from tests.polling import wait_until
from tests.tls_certs import TestPKI

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return TestPKI(tmp_path_factory.mktemp("kv-tls"))


def member(pki: TestPKI, name: str, *, stranger: bool = False, expired: bool = False) -> ServerTLS:
    cert, key = pki.issue(name, ca=pki.other if stranger else None, expired=expired)
    return ServerTLS(cert, key, client_ca=pki.ca_file, require_client_cert=True, where="tls.cluster")


def send(sender: KVSender, receiver: KVReceiver, cache, lease, forge: bool = False):
    target = receiver.target(lease)
    if forge:
        target.handle = secrets.token_bytes(16)
    ids = list(range(1, 1 + len(lease.block_ids)))
    return sender.send(target, ids, lease.num_tokens, FIRST).result(timeout=20), ids


def test_tls_handoff_lands_bit_exact_and_reuses_the_connection(pki):
    layout = make_layout("bfloat16")
    cache, alloc = make_cache(layout, 31), ShuffledFreeList(NUM_BLOCKS, 6)
    server = member(pki, "decode-0").ssl_context()
    with (
        KVReceiver(layout, landing := make_cache(layout, 32), alloc, config(), tls=server) as receiver,
        KVSender(layout, cache, config(), tls=member(pki, "prefill-0").member_client_context()) as sender,
    ):
        for rid in ("a", "b"):
            lease = receiver.reserve(rid, 11)
            sent, ids = send(sender, receiver, cache, lease)
            (result,) = wait_results(receiver)
            assert sent.ok and result.ok and result.first_token == FIRST, (sent, result)
            assert checksum(landing, lease.block_ids) == checksum(cache, ids)
        assert "channel" in sent.phases  # the second handoff reused the TLS connection: no new handshake
        assert receiver.stats().refused == {}


@pytest.mark.parametrize("peer", ["plaintext", "stranger", "expired"])
def test_a_peer_without_a_cluster_certificate_is_refused_and_the_lease_still_serves(pki, peer):
    layout = make_layout("float32")
    cache, alloc = make_cache(layout, 33), ShuffledFreeList(NUM_BLOCKS, 7)
    receiver_cache = make_cache(layout, 34)
    with KVReceiver(
        layout, receiver_cache, alloc, config(), tls=member(pki, "decode-1").ssl_context()
    ) as receiver:
        lease = receiver.reserve("req", 27)
        before = checksum(receiver_cache, range(1, NUM_BLOCKS))
        tls = None
        if peer != "plaintext":
            tls = member(pki, f"rogue-{peer}", stranger=peer == "stranger", expired=peer == "expired")
        with KVSender(layout, cache, config(), tls=tls.member_client_context() if tls else None) as rogue:
            refused, _ = send(rogue, receiver, cache, lease)
        assert not refused.ok and refused.failure in (
            FailureReason.CONNECTION_LOST,
            FailureReason.CONNECT_FAILED,
        )
        if peer == "plaintext":
            assert "require TLS" in refused.message, refused.message
        assert checksum(receiver_cache, range(1, NUM_BLOCKS)) == before  # not a byte landed
        wait_until(lambda: receiver.stats().refused.get("tls_handshake"), what="the refusal to be counted")
        time.sleep(0.5)
        assert receiver.poll() == []  # the lease is untouched: still reserved for the real sender
        with KVSender(layout, cache, config(), tls=member(pki, "prefill-1").member_client_context()) as real:
            sent, ids = send(real, receiver, cache, lease)
        (result,) = wait_results(receiver)
        assert sent.ok and result.ok and checksum(receiver_cache, lease.block_ids) == checksum(cache, ids)


def test_a_forged_handle_over_a_good_connection_is_refused_and_counted(pki):
    layout = make_layout("float32")
    cache, alloc = make_cache(layout, 35), ShuffledFreeList(NUM_BLOCKS, 8)
    receiver_cache = make_cache(layout, 36)
    with (
        KVReceiver(
            layout, receiver_cache, alloc, config(), tls=member(pki, "decode-2").ssl_context()
        ) as receiver,
        KVSender(layout, cache, config(), tls=member(pki, "prefill-2").member_client_context()) as sender,
    ):
        lease = receiver.reserve("req", 11)
        before = checksum(receiver_cache, range(1, NUM_BLOCKS))
        forged, _ = send(sender, receiver, cache, lease, forge=True)
        assert forged.failure is FailureReason.UNKNOWN_HANDLE
        assert checksum(receiver_cache, range(1, NUM_BLOCKS)) == before
        assert receiver.stats().refused == {"unknown_handle": 1}
        sent, ids = send(sender, receiver, cache, lease)  # the real handle still works
        (result,) = wait_results(receiver)
    assert sent.ok and result.ok and checksum(receiver_cache, lease.block_ids) == checksum(cache, ids)
