"""The `application_name` of a member's connections (decision 0027): PostgreSQL keeps
63 bytes of it, and the role must survive the cut (found by attack: a long default
member name hid it, and the three backends could not be told apart)."""

from __future__ import annotations

from pgq.store.connections import NAME_BYTES, application_name

HOST = "ip-172-31-20-123.eu-central-1.compute.internal"


def test_a_short_name_is_kept_whole():
    assert application_name("billing", "m1", "session") == "pgq/billing/m1/session"


def test_a_long_member_name_keeps_its_start_its_end_and_the_role():
    names = {
        role: application_name("billing", f"{HOST}:4242:ab12", role)
        for role in ("session", "claims", "work")
    }
    for role, name in names.items():
        assert len(name.encode()) <= NAME_BYTES
        assert name.startswith("pgq/billing/ip-172-31-20")
        assert name.endswith(f"~:4242:ab12/{role}"), name
    assert len(set(names.values())) == 3


def test_a_long_group_and_a_multibyte_member_are_cut_on_character_boundaries():
    name = application_name("g" * 63, "ü" * 40 + ":7:ffff", "claims")
    assert len(name.encode()) <= NAME_BYTES
    assert name.startswith("pgq/" + "g" * 20 + "/ü")
    assert "~" in name and name.endswith(":7:ffff/claims")
    name.encode().decode()  # whole characters only
