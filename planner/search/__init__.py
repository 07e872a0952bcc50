"""Search: the DAPPLE plan search (eq. 4-5), its bounds, seeds and placement, schedule choice, and the baselines."""
