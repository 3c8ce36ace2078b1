"""Reverse DNS lookups that stall: torch.distributed's store looks up each peer's address until a lookup fails (once
per process), so a silent nameserver costs every worker glibc's 5 s timeout twice. The driver finds such lookups
and gives the workers a resolver that gives up after 1 s."""

from __future__ import annotations

import socket
import threading

import pytest

from rlinf_pipe.runner import components
from rlinf_pipe.runner.components import resolver_env
from rlinf_pipe.utils.net import QUICK_RESOLVER, RESOLVER_ENV, quick_resolver_env, stalled_reverse_lookups

SILENT, ANSWERED, UNKNOWN = "10.9.8.7", "10.9.8.6", "10.9.8.5"


@pytest.fixture
def resolver(monkeypatch):
    """getnameinfo that never answers for SILENT (until the test ends), names ANSWERED, and knows no name for
    UNKNOWN; records the addresses asked."""
    release, asked = threading.Event(), []

    def getnameinfo(address, flags):
        asked.append(address[0])
        if address[0] == SILENT:
            release.wait()
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        if address[0] == UNKNOWN:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return "node-6", "0"

    monkeypatch.setattr(socket, "getnameinfo", getnameinfo)
    yield asked
    release.set()


def test_only_the_lookups_that_do_not_answer_are_stalled(resolver):
    assert stalled_reverse_lookups([ANSWERED, SILENT, UNKNOWN, SILENT], within_s=2.0) == [SILENT]
    assert sorted(resolver) == sorted([ANSWERED, SILENT, UNKNOWN])  # each address asked once


def test_workers_get_a_quick_resolver_only_where_a_lookup_stalls(resolver):
    assert quick_resolver_env([ANSWERED, UNKNOWN], {}) == ({}, [])
    assert quick_resolver_env([ANSWERED, SILENT], {}) == ({RESOLVER_ENV: QUICK_RESOLVER}, [SILENT])


def test_a_resolver_the_user_chose_is_kept_and_nothing_is_looked_up(resolver):
    assert quick_resolver_env([SILENT], {RESOLVER_ENV: "timeout:2"}) == ({}, [])
    assert resolver == []


def test_the_driver_says_which_lookups_stalled_and_how_to_remove_the_wait(resolver, monkeypatch, capsys):
    monkeypatch.delenv(RESOLVER_ENV, raising=False)
    monkeypatch.setattr(components, "RESOLVER_CHOICES", {})
    assert resolver_env([SILENT, ANSWERED]) == {RESOLVER_ENV: QUICK_RESOLVER}
    said = capsys.readouterr().out
    assert SILENT in said and ANSWERED not in said and "/etc/hosts" in said and RESOLVER_ENV in said
    assert resolver_env([ANSWERED]) == {} and capsys.readouterr().out == ""


def test_a_relaunch_on_the_same_nodes_keeps_the_choice_without_asking_again(resolver, monkeypatch, capsys):
    monkeypatch.delenv(RESOLVER_ENV, raising=False)
    monkeypatch.setattr(components, "RESOLVER_CHOICES", {})
    assert resolver_env([SILENT, ANSWERED]) == {RESOLVER_ENV: QUICK_RESOLVER}
    capsys.readouterr()
    asked = len(resolver)
    assert resolver_env([ANSWERED, SILENT, ANSWERED]) == {RESOLVER_ENV: QUICK_RESOLVER}
    assert len(resolver) == asked and capsys.readouterr().out == ""  # no lookup, no second message
