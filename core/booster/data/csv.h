// Numeric CSV files as features and a label column: the table a spreadsheet or pandas.to_csv writes.
//
// Note [CSV data]
// ~~~~~~~~~~~~~~~
// Every row has the same number of cells, separated by `delimiter`; every cell is a number (decimal or
// scientific notation, surrounding spaces allowed). One column is the label, the others are the
// features, in file order. The first row is a header of column names when `header` says so; "auto"
// takes it for a header when any of its cells is not a number. Empty lines are skipped, "\r\n" line
// ends are read as "\n", and a cell may be double-quoted ("3.5", "petal width"). A cell that is not a
// number is a DataError naming the file, the row (1-based, as an editor shows it), the column (index
// and name) and the text.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "booster/data/npy.h"

namespace booster::data {

struct CsvOptions {
  char delimiter = ',';
  // Whether the first row holds column names: nullopt decides by its cells (Note [CSV data]).
  std::optional<bool> header;
  // The label column by name (needs a header) or by index (negative: from the end, -1 the last).
  std::optional<std::string> label_name;
  int64_t label_index = -1;
};

struct CsvTable {
  Array features;  // float64 [rows, columns - 1]
  Array labels;    // float64 [rows]
  std::vector<std::string> feature_names;  // empty without a header
  std::string label_name;                  // "" without a header
};

// DataError naming the file: missing or unreadable, empty, ragged rows, non-numeric cells, a label
// column that does not exist.
CsvTable read_csv(const std::filesystem::path& path, const CsvOptions& options = {});

}  // namespace booster::data
