// CSV reading (Note [CSV data] in csv.h).
#include "booster/data/csv.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include "booster/common/error.h"
#include "booster/data/dataset.h"

namespace booster::data {

namespace {

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  const size_t e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

// One line into cells: split at the delimiter outside double quotes, quotes removed ("" is a quote).
std::vector<std::string> split_cells(const std::string& line, char delimiter) {
  std::vector<std::string> cells;
  std::string cell;
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (c == '"') {
      if (quoted && i + 1 < line.size() && line[i + 1] == '"') cell += '"', ++i;
      else quoted = !quoted;
    } else if (c == delimiter && !quoted) {
      cells.push_back(trim(cell));
      cell.clear();
    } else {
      cell += c;
    }
  }
  cells.push_back(trim(cell));
  return cells;
}

bool parse_number(const std::string& cell, double& out) {
  if (cell.empty()) return false;
  const char* begin = cell.data();
  const char* end = begin + cell.size();
  if (*begin == '+') ++begin;  // from_chars takes no leading '+'
  const auto [ptr, ec] = std::from_chars(begin, end, out);
  return ec == std::errc() && ptr == end;
}

}  // namespace

CsvTable read_csv(const std::filesystem::path& path, const CsvOptions& options) {
  const std::string file = path.string();
  std::error_code exists_ec;
  BOOSTER_CHECK(std::filesystem::exists(path, exists_ec), DataError, "csv data: ", file,
                " does not exist; expected a CSV file of numeric features and a label column");
  check_data_file(path, "csv data: ", "expected a CSV file of numeric features and a label column");
  std::ifstream in(path, std::ios::binary);
  BOOSTER_CHECK(in.good(), DataError, "csv data: cannot open ", file, ": ", std::strerror(errno));

  std::vector<std::string> names;
  std::vector<double> values;  // row-major, all columns
  size_t columns = 0;
  int64_t rows = 0;
  int64_t line_number = 0;
  bool first = true;
  std::string line;
  while (std::getline(in, line)) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (trim(line).empty()) continue;
    std::vector<std::string> cells = split_cells(line, options.delimiter);
    // A NUL would cut every message that shows the cell (and the header names taken from it).
    for (size_t c = 0; c < cells.size(); ++c) {
      if (cells[c].find('\0') == std::string::npos) continue;
      BOOSTER_FAIL(DataError, "csv data: ", file, " line ", line_number, ", column ", c,
                   c < names.size() ? " (\"" + names[c] + "\")" : std::string(),
                   ": the cell holds a NUL byte (\\0) at character ", line.find('\0') + 1,
                   " of the line; a CSV file is text (is it a binary file, or saved as UTF-16?)");
    }
    if (first) {
      first = false;
      columns = cells.size();
      BOOSTER_CHECK(columns >= 2, DataError, "csv data: ", file, " row ", line_number, " has ", columns,
                    " column; expected features and a label (is the delimiter '", options.delimiter, "' right?)");
      bool is_header = false;
      if (options.header) {
        is_header = *options.header;
      } else {
        double ignored = 0;
        for (const std::string& c : cells) is_header = is_header || !parse_number(c, ignored);
      }
      if (is_header) {
        names = cells;
        continue;
      }
    }
    BOOSTER_CHECK(cells.size() == columns, DataError, "csv data: ", file, " row ", line_number, " has ", cells.size(),
                  " cells but the first row has ", columns, "; every row needs the same columns");
    for (size_t c = 0; c < cells.size(); ++c) {
      double v = 0;
      if (!parse_number(cells[c], v)) {
        const std::string column = names.empty() ? "" : " (\"" + names[c] + "\")";
        BOOSTER_FAIL(DataError, "csv data: ", file, " row ", line_number, ", column ", c, column, ": \"", cells[c],
                     "\" is not a number; every cell but those of a header row must be numeric");
      }
      values.push_back(v);
    }
    ++rows;
  }
  BOOSTER_CHECK(rows > 0, DataError, "csv data: ", file, " has no data rows");

  // The label column.
  int64_t label = 0;
  if (options.label_name) {
    BOOSTER_CHECK(!names.empty(), DataError, "csv data: ", file, " has no header row, so the label column cannot be \"",
                  *options.label_name, "\"; give its index instead, or add a header");
    auto it = std::find(names.begin(), names.end(), *options.label_name);
    BOOSTER_CHECK(it != names.end(), DataError, "csv data: ", file, " has no column \"", *options.label_name,
                  "\"; its columns are ", names);
    label = int64_t(it - names.begin());
  } else {
    label = options.label_index < 0 ? int64_t(columns) + options.label_index : options.label_index;
    BOOSTER_CHECK(label >= 0 && label < int64_t(columns), DataError, "csv data: ", file, " has ", columns,
                  " columns, so label column ", options.label_index, " does not exist; expected -", columns, " to ",
                  columns - 1);
  }

  CsvTable t;
  const int64_t features = int64_t(columns) - 1;
  t.features.dtype = ArrayDType::Float64;
  t.features.shape = {rows, features};
  t.features.bytes.resize(size_t(rows * features) * sizeof(double));
  t.labels.dtype = ArrayDType::Float64;
  t.labels.shape = {rows};
  t.labels.bytes.resize(size_t(rows) * sizeof(double));
  auto* fx = reinterpret_cast<double*>(t.features.bytes.data());
  auto* fy = reinterpret_cast<double*>(t.labels.bytes.data());
  for (int64_t r = 0; r < rows; ++r) {
    int64_t k = 0;
    for (int64_t c = 0; c < int64_t(columns); ++c) {
      const double v = values[size_t(r) * columns + size_t(c)];
      if (c == label) fy[r] = v;
      else fx[r * features + k++] = v;
    }
  }
  if (!names.empty()) {
    t.label_name = names[size_t(label)];
    for (int64_t c = 0; c < int64_t(columns); ++c)
      if (c != label) t.feature_names.push_back(names[size_t(c)]);
  }
  return t;
}

}  // namespace booster::data
