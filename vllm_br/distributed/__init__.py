"""Multi-device support: the SUPA device communicator, the allreduce strategy
and the supernode TP group layout."""
