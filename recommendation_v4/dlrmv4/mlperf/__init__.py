"""MLPerf compliance: the run log, closed-division checks, rules for non-reference datasets."""
