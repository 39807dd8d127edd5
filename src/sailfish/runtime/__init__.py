"""The layer below the kernel families: environment switches (flags), device facts (device),
the direct kernel launch (launch), the torch.library plumbing (dispatch) and the steady-state
plan machinery every family plugs into (plan)."""
