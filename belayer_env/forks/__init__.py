"""Forks: N sandboxes from one checkpoint (``fork``), containers created ahead for them
(``ForkPool``), and what every fork of a checkpoint needs verified once (``ahead``)."""
