"""The ``local`` node backend: the project's own DRAM/disk tier."""
