"""The processes of one run: ``process_start`` (the launcher's environment, the device, joining the
group), ``cluster`` (what a rank sees and the collectives the loop needs), ``liveness`` (a rank's
failure, the others' watch, the signs of life that name a lost rank, a rank's end) and
``rendezvous_port`` (what answers at a rendezvous address)."""
