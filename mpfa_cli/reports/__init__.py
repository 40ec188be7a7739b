"""What results are shown as: tables, plots and the regression gate."""
