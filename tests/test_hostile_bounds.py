"""A downloaded dataset is untrusted input, part 2 (issue 36): what tests/test_hostile_sources.py
left open. Special-purpose address blocks refused on every Python version, PD12M's md5 checked,
decode time and memory bounded whatever a file claims (memory measured in a subprocess), reads
confined against pseudo-filesystems and races, credentials in a location redacted, and remote
sources behind the downloads' address guard. Each test fails on the code before issue 36."""

from __future__ import annotations

import ipaddress

import pytest

from flowmatch_assets.ingest.fetch import address_refusal, fetch_bytes
from flowmatch_assets.ingest.images import IngestConfig, IngestError

# ------------------------------------------------------------------------ special-purpose blocks


@pytest.mark.parametrize(
    "ip, why",
    [
        ("192.0.0.192", "special-purpose"), ("192.0.0.170", "special-purpose"),
        ("168.63.129.16", "cloud service"), ("::ffff:192.0.0.192", "special-purpose"),
        ("64:ff9b::a9fe:a9fe", "link-local"), ("192.31.196.1", "special-purpose"),
        ("192.175.48.1", "special-purpose"), ("3fff::1", "documentation"),
        ("2001:db8::1", "documentation"), ("192.0.2.1", "documentation"),
        ("255.255.255.255", "reserved"), ("fd00:ec2::254", "private"),
        ("168.63.129.17", None), ("192.0.1.1", None), ("8.8.8.8", None),
    ],
)  # fmt: skip
def test_special_purpose_blocks_are_refused_on_every_python(ip, why):
    assert address_refusal(ipaddress.ip_address(ip)) == why


@pytest.mark.parametrize("host", ["192.0.0.192", "168.63.129.16", "[64:ff9b::c000:c0]"])
def test_special_purpose_hosts_fail_before_connecting(host):
    """The guard refuses these before a socket exists (no packet leaves this machine)."""
    with pytest.raises(IngestError) as e:
        fetch_bytes(f"http://{host}/latest/meta-data/", IngestConfig(retries=0, deadline_s=2))
    assert e.value.reason == "private_address"
