"""The rule lists as data: the op lists and node overrides a conversion decides by, loaded from
the TOML files in :mod:`amp_rewrite.rules.defaults` (``rules/`` in a checkout) and the
user's."""
