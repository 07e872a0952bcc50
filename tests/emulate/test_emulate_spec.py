"""`dapple emulate --topology=...`: the spec and rate parsers, against tables written by hand,
and clear errors for bad input. No root needed."""
import pytest

from dapple.emulate_spec import (MIN_BURST_BYTES, EmulateError, default_burst_bytes,
                                 parse_emulated_cluster, tc_rate)

KIB, MIB = 1024, 2 ** 20

SPECS = [
    # (spec, ranks per host, rate bytes/s, tc rate, burst bytes: 2 ms at the rate, >= 64 KiB)
    ("2x2,net=200Mbps", (2, 2), 25e6, "200000000bit", 64 * KIB),
    ("2x1,net=1Gbps", (1, 1), 125e6, "1000000000bit", 250_000),
    ("4x8,net=25MB/s", (8, 8, 8, 8), 25e6, "200000000bit", 64 * KIB),
    ("2+1,net=10Gbps", (2, 1), 1.25e9, "10000000000bit", 2_500_000),
    ("1x3,net=100kbps", (3,), 12.5e3, "100000bit", 64 * KIB),
    ("2x2,net=1.5Gbps,burst=1MiB", (2, 2), 187.5e6, "1500000000bit", MIB),
    ("2x2, net = 200Mbps , burst=512KiB", (2, 2), 25e6, "200000000bit", 512 * KIB),
    ("2X2,net=200Mbps", (2, 2), 25e6, "200000000bit", 64 * KIB),
]


@pytest.mark.parametrize("spec, counts, rate, tc, burst", SPECS, ids=[s[0] for s in SPECS])
def test_spec_table(spec, counts, rate, tc, burst):
    cluster = parse_emulated_cluster(spec)
    assert cluster.ranks_per_host == counts
    assert cluster.rate_bytes_per_s == pytest.approx(rate)
    assert cluster.tc_rate == tc
    assert cluster.burst_bytes == burst
    assert cluster.num_ranks == sum(counts) and cluster.num_hosts == len(counts)


RATES = [
    # (bytes/s, tc's argument): whole bits per second
    (25e6, "200000000bit"),
    (125e6, "1000000000bit"),
    (1e3, "8000bit"),
    (12.5e6 / 3, "33333333bit"),
]


@pytest.mark.parametrize("rate, tc", RATES)
def test_rate_table(rate, tc):
    assert tc_rate(rate) == tc


def test_burst_holds_2_ms_at_the_rate_and_at_least_64_kib():
    assert default_burst_bytes(25e6) == MIN_BURST_BYTES == 64 * KIB    # 50 kB per 2 ms
    assert default_burst_bytes(125e6) == 250_000                       # 1 Gbps
    assert default_burst_bytes(1.25e9) == 2_500_000                    # 10 Gbps


BAD = [
    ("", "--topology is required"),
    ("2x2", "needs the hosts' link rate, net=RATE"),
    ("2x2,net=", "cannot read a bandwidth"),
    ("2x2,net=fast", "cannot read a bandwidth"),
    ("2x2,net=200", "unknown bandwidth unit"),
    ("2x2,net=200mbit", "unknown bandwidth unit"),
    ("2x2,net=0Mbps", "must be positive"),
    ("2x2,net=1kbps", "below what tc's token bucket shapes"),
    ("2x2,rate=200Mbps", "key=value with key one of net, burst"),
    ("2x2,200Mbps", "key=value"),
    ("2x2,net=1Gbps,net=2Gbps", "net= twice"),
    ("2x2,net=1Gbps,burst=1KiB", "below 64 KiB"),
    ("2x2,net=1Gbps,burst=lots", "should be a size"),
    ("0x2,net=1Gbps", "at least one rank"),
    ("2x0,net=1Gbps", "at least one rank"),
    ("2+0,net=1Gbps", "at least one rank"),
    ("two hosts,net=1Gbps", "start with HOSTSxRANKS"),
    ("A", "start with HOSTSxRANKS"),
]


@pytest.mark.parametrize("spec, words", BAD, ids=[b[0] or "empty" for b in BAD])
def test_bad_specs_say_what_is_wrong(spec, words):
    with pytest.raises(EmulateError, match=words.replace("(", r"\(").replace("=", "=")):
        parse_emulated_cluster(spec)
