"""credproxy against bare mitmproxy and a direct connection, interleaved in one run."""
