"""`forge-train --plan --search`: every valid layout of a world size, its predicted memory and step time, ranked."""
