"""`distrun doctor`'s warning about a data plane on a public address (gloo/NCCL are plaintext)."""

from __future__ import annotations

import pytest

from distrun.client.doctor import _public


@pytest.mark.parametrize("address, public", [("10.199.0.11", None), ("192.168.1.4", None), ("127.0.0.1", None),
                                              ("fe80::1", None), ("8.8.8.8", "8.8.8.8"), ("2001:4860::8888", "2001:4860::8888"),
                                              (None, None), ("gpu-1", None)])
def test_doctor_calls_a_globally_routable_data_plane_address_public(address: object, public: str | None) -> None:
    assert _public(address) == public
