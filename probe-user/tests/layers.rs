//! No cycles between probe-user's modules (style.md: render → analysis → recording → common;
//! nothing lower imports anything higher). Reads the sources: a module's dependencies are the
//! `crate::NAME` paths in its code (comments and tests left out).
use std::collections::{BTreeMap, BTreeSet};

fn sources(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Top-level names a piece of code takes from `crate::`.
fn used(code: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + 7..];
        if let Some(group) = rest.strip_prefix('{') {
            // `use crate::{a::b, c, d::{e, f}}`: the names at depth 0.
            let (mut depth, mut start) = (0, 0);
            for (j, ch) in group.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        names.insert(ident(group[start..j].trim()));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        names.insert(ident(group[start..j].trim()));
                        start = j + 1;
                    }
                    _ => {}
                }
            }
        } else {
            names.insert(ident(rest));
        }
    }
    names.retain(|n| !n.is_empty());
    names
}

#[test]
fn modules_do_not_import_each_other_in_a_cycle() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    sources(&src, &mut files);
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let module = rel.components().next().unwrap().as_os_str().to_string_lossy().trim_end_matches(".rs").to_string();
        if module == "lib" || module == "main" {
            continue;
        }
        let text = std::fs::read_to_string(f).unwrap();
        let code: String =
            text.split("#[cfg(test)]").next().unwrap().lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
        let mut names = used(&code);
        names.remove(&module);
        deps.entry(module).or_default().extend(names);
    }
    let modules: BTreeSet<String> = deps.keys().cloned().collect();
    for d in deps.values_mut() {
        d.retain(|n| modules.contains(n));
    }
    assert!(deps["report"].contains("recording") && deps["html"].contains("report"), "the scan found no dependencies: {deps:?}");
    // A module in a cycle reaches itself.
    let mut cycles = vec![];
    for m in &modules {
        let (mut seen, mut todo): (BTreeSet<&str>, Vec<&str>) = (BTreeSet::new(), deps[m].iter().map(String::as_str).collect());
        while let Some(n) = todo.pop() {
            if n == m {
                cycles.push(m.clone());
                break;
            }
            if seen.insert(n) {
                todo.extend(deps[n].iter().map(String::as_str));
            }
        }
    }
    assert!(cycles.is_empty(), "modules in an import cycle: {cycles:?}\n{deps:#?}");
}

/// The submodules of one module, as nodes: `(file, name)`; `mod.rs` and the parent's own file
/// are left out (a parent declares and re-exports its children; a child using an item its
/// parent defines is not a cycle between siblings).
fn submodules(src: &std::path::Path) -> BTreeMap<String, Vec<(std::path::PathBuf, String)>> {
    let mut out: BTreeMap<String, Vec<(std::path::PathBuf, String)>> = BTreeMap::new();
    for e in std::fs::read_dir(src).unwrap().flatten() {
        let dir = e.path();
        if !dir.is_dir() {
            continue;
        }
        let parent = dir.file_name().unwrap().to_string_lossy().to_string();
        let mut files = vec![];
        sources(&dir, &mut files);
        for f in files {
            let rel = f.strip_prefix(&dir).unwrap();
            let name = rel.components().next().unwrap().as_os_str().to_string_lossy().trim_end_matches(".rs").to_string();
            if name != "mod" {
                out.entry(parent.clone()).or_default().push((f, name));
            }
        }
    }
    out
}

/// Sibling names a submodule's code takes: `super::NAME`, `crate::PARENT::NAME`, and the names
/// in `super::{...}` groups.
fn siblings_used(code: &str, parent: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for prefix in ["super::".to_string(), format!("crate::{parent}::")] {
        for (i, _) in code.match_indices(&prefix) {
            // `crate::bench::` inside `crate::other_bench::` is not this prefix.
            if code[..i].chars().next_back().is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            // This path alone: up to the end of its statement, and before any other path.
            let rest = &code[i + prefix.len()..];
            let end = [rest.find(';'), rest.find("crate::"), rest.find("super::")].into_iter().flatten().min().unwrap_or(rest.len());
            names.extend(used(&format!("crate::{}", &rest[..end])));
        }
    }
    names
}

/// No cycles between the files of one module either (bench::output ↔ bench::vllm was one):
/// imports through `super::` and `crate::PARENT::` are followed.
#[test]
fn submodules_do_not_import_each_other_in_a_cycle() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all_cycles = vec![];
    let mut edges = 0;
    for (parent, files) in submodules(&src) {
        let names: BTreeSet<String> = files.iter().map(|(_, n)| n.clone()).collect();
        let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (f, name) in &files {
            let text = std::fs::read_to_string(f).unwrap();
            let code: String = text
                .split("#[cfg(test)]")
                .next()
                .unwrap()
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            let mut used = siblings_used(&code, &parent);
            used.retain(|n| names.contains(n) && n != name);
            edges += used.len();
            deps.entry(name.clone()).or_default().extend(used);
        }
        for m in &names {
            let (mut seen, mut todo): (BTreeSet<&str>, Vec<&str>) =
                (BTreeSet::new(), deps.get(m).into_iter().flatten().map(String::as_str).collect());
            while let Some(n) = todo.pop() {
                if n == m {
                    all_cycles.push(format!("{parent}::{m}: {:?}", deps));
                    break;
                }
                if seen.insert(n) {
                    todo.extend(deps.get(n).into_iter().flatten().map(String::as_str));
                }
            }
        }
    }
    assert!(edges > 10, "the scan found {edges} sibling imports: it reads nothing");
    assert!(all_cycles.is_empty(), "submodules in an import cycle:\n{}", all_cycles.join("\n"));
}
