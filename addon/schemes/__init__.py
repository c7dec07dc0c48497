"""How a stored credential becomes bytes on a request: stamps, SigV4, minted tokens and
their renewal."""
