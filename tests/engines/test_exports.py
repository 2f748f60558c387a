"""The public names of ``icefloe.engines`` stay sorted and importable."""

import icefloe.engines as engines


def test_engines_all_is_sorted_and_every_name_resolves():
    assert engines.__all__ == sorted(engines.__all__)
    for name in engines.__all__:
        assert getattr(engines, name) is not None, name
