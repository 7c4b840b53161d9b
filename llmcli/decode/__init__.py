"""Step 5, the one answer loop: the scheduler (slots, one step), speculative drafting, and its three clients."""
