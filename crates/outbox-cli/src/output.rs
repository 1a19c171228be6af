//! Plain-text tables and JSON output.

use std::io::Write;

use serde::Serialize;

use crate::error::CliError;

/// Writes `value` as pretty JSON and a newline.
pub(crate) fn json<T: Serialize>(out: &mut dyn Write, value: &T) -> Result<(), CliError> {
    serde_json::to_writer_pretty(&mut *out, value).map_err(std::io::Error::other)?;
    writeln!(out)?;
    Ok(())
}

/// Writes an aligned table: a header line, then one line per row.
pub(crate) fn table(
    out: &mut dyn Write,
    headers: &[&str],
    rows: &[Vec<String>],
) -> Result<(), CliError> {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut text = String::new();
        for (i, (cell, w)) in cells.zip(&widths).enumerate() {
            if i > 0 {
                text.push_str("  ");
            }
            text.push_str(cell);
            if i + 1 < widths.len() {
                text.extend(std::iter::repeat_n(' ', w - cell.chars().count()));
            }
        }
        text.trim_end().to_owned()
    };
    writeln!(out, "{}", line(&mut headers.iter().copied()))?;
    for row in rows {
        writeln!(out, "{}", line(&mut row.iter().map(String::as_str)))?;
    }
    Ok(())
}

/// `value` or `-`.
pub(crate) fn opt<T: ToString>(value: Option<T>) -> String {
    value.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

/// Seconds with one decimal, or `-`.
pub(crate) fn secs(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |s| format!("{s:.1}s"))
}

/// At most `max` characters, single line.
pub(crate) fn short(text: Option<&str>, max: usize) -> String {
    let Some(text) = text else {
        return "-".to_owned();
    };
    let one_line: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if one_line.chars().count() <= max {
        one_line
    } else {
        let mut cut: String = one_line.chars().take(max.saturating_sub(1)).collect();
        cut.push('…');
        cut
    }
}
