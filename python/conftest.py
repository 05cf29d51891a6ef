"""pytest setup for the binding's tests: ends the run with the one-line summary
("N passed, N failed[, N skipped]") that tests/run_all.sh adds up."""


def pytest_terminal_summary(terminalreporter):
    stats = terminalreporter.stats
    passed = len(stats.get("passed", []))
    failed = len(stats.get("failed", [])) + len(stats.get("error", []))
    skipped = len(stats.get("skipped", []))
    line = "%d passed, %d failed" % (passed, failed)
    if skipped:
        line += ", %d skipped" % skipped
    terminalreporter.write_line(line)
