"""Reports built only from stored result records: the HTML dashboard, publication tables, compare.

May import: sweep, predict, train, hardware, data, records, backends, model.
"""

from echobench.report.compare import compare_records
from echobench.report.dashboard import render_dashboard
from echobench.report.data import ReportInput, load_report_input
from echobench.report.tables import read_reference, render_table

__all__ = ["ReportInput", "compare_records", "load_report_input", "read_reference", "render_dashboard",
           "render_table"]
