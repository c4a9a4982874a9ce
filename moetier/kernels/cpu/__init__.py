"""Kernels that run on the host's cores: the CPU expert kernel of hybrid misses (C, built at first
use by the host's compiler; the torch twin where there is none) and the DRAM read measurement the
hybrid cost model divides CPU-side bytes by."""
