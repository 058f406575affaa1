"""The control plane: the coordinator actor and what it alone owns (directory, transfer ledger, prefix index)."""
