//! The layers of probe-user (style.md: render → analysis → record → common; nothing lower
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

/// No cycles between probe-user's modules (a folder's children are modules of their own:
/// `analysis/verdict`, `render/html`), whatever their layers.
#[test]
fn modules_do_not_import_each_other_in_a_cycle() {
    let (files, dirs) = tree();
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, top, parent, code) in &files {
        let _ = top;
        let to: BTreeSet<String> = paths(code, parent.as_deref()).iter().filter_map(|p| node_of(p, &dirs)).filter(|t| t != from).collect();
        deps.entry(from.clone()).or_default().extend(to);
    }
    let modules: BTreeSet<String> = deps.keys().cloned().collect();
    for d in deps.values_mut() {
        d.retain(|n| modules.contains(n));
    }
    assert!(
        deps["analysis"].contains("record") && deps["render/html"].contains("analysis/report"),
        "the scan found no dependencies: {deps:?}"
    );
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
            names.extend(paths(&format!("crate::{}", &rest[..end]), None).iter().filter_map(|p| p.split("::").next().map(str::to_string)));
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

/// The layers of the data path, lowest first: a module may import from its own layer or any
/// below, never above. The machine and small helpers (`os`, `util`, and the crate root's
/// `monotonic_ns`, `exit`, `parse_duration_or`); the recording format and the request streams
/// it holds (`record`, `stream`); the one read of a recording and everything computed from it
/// (`analysis`); what people see (`render`); the live parts of a trace (`kernel`, `sampler`,
/// then `collector`, then `watch` and `bench`, which run it); the subcommands (`cmd`).
const RANKS: [(&str, u32); 12] = [
    ("os", 0),
    ("util", 0),
    ("record", 1),
    ("stream", 1),
    ("analysis", 2),
    ("render", 3),
    ("kernel", 4),
    ("sampler", 4),
    ("collector", 5),
    ("watch", 6),
    ("bench", 6),
    ("cmd", 7),
];

/// The node a `crate::` path names: `top/child` for a module folder's child, else `top`.
fn node_of(path: &str, dirs: &BTreeMap<String, BTreeSet<String>>) -> Option<String> {
    let mut segs = path.split("::");
    let top = segs.next()?;
    match (dirs.get(top), segs.next()) {
        (Some(children), Some(c)) if children.contains(c) => Some(format!("{top}/{c}")),
        (Some(_), _) => Some(top.to_string()),
        (None, _) => None,
    }
}

/// Every `crate::a::b` path (and `super::b` inside a folder) in a piece of code, groups opened.
fn paths(code: &str, parent: Option<&str>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':').collect::<String>();
    let mut add = |prefix: &str, rest: &str| {
        if let Some(group) = rest.strip_prefix('{') {
            let (mut depth, mut start) = (0, 0);
            for (j, ch) in group.char_indices() {
                match ch {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.insert(format!("{prefix}{}", ident(group[start..j].trim())));
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.insert(format!("{prefix}{}", ident(group[start..j].trim())));
                        start = j + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.insert(format!("{prefix}{}", ident(rest)));
        }
    };
    for (i, _) in code.match_indices("crate::") {
        add("", &code[i + 7..]);
    }
    if let Some(p) = parent {
        for (i, _) in code.match_indices("super::") {
            if !code[..i].ends_with("super::") {
                add(&format!("{p}::"), &code[i + 7..]);
            }
        }
    }
    let out: BTreeSet<String> = out.into_iter().map(|p| p.trim_end_matches(":").to_string()).filter(|p| !p.is_empty()).collect();
    out
}

/// probe-user's source files outside lib.rs and main.rs, each as (its module node, its folder,
/// the folder `super::` names in it, its code without comments and tests), and the folders with
/// their children's names. A file outside a folder fails: every module has a layer.
type Files = Vec<(String, String, Option<String>, String)>;
fn tree() -> (Files, BTreeMap<String, BTreeSet<String>>) {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut dirs: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut paths = vec![];
    for e in std::fs::read_dir(&src).unwrap().flatten() {
        let p = e.path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if p.is_dir() {
            let children = std::fs::read_dir(&p).unwrap().flatten().map(|c| c.path().file_stem().unwrap().to_string_lossy().to_string());
            dirs.insert(name.clone(), children.filter(|c| c != "mod").collect());
            sources(&p, &mut paths);
        } else if name != "lib.rs" && name != "main.rs" {
            panic!("src/{name}: a module outside the layers' folders ({RANKS:?})");
        }
    }
    let mut files = vec![];
    for f in &paths {
        let rel = f.strip_prefix(&src).unwrap();
        let comps: Vec<String> = rel.components().map(|c| c.as_os_str().to_string_lossy().trim_end_matches(".rs").to_string()).collect();
        let top = comps[0].clone();
        let from = if comps.len() > 2 || comps[1] != "mod" { format!("{top}/{}", comps[1]) } else { top.clone() };
        let text = std::fs::read_to_string(f).unwrap();
        let code: String =
            text.split("#[cfg(test)]").next().unwrap().lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n");
        let parent = (comps.len() == 2).then(|| top.clone());
        files.push((from, top, parent, code));
    }
    (files, dirs)
}

#[test]
fn imports_point_down_the_data_path() {
    let rank: BTreeMap<&str, u32> = RANKS.into_iter().collect();
    let (files, dirs) = tree();
    for d in dirs.keys() {
        assert!(rank.contains_key(d.as_str()), "src/{d}: a folder with no rank in the layers test");
    }
    let (mut up, mut edges) = (vec![], 0);
    for (from, top, parent, code) in &files {
        for p in paths(code, parent.as_deref()) {
            let Some(to) = node_of(&p, &dirs) else { continue };
            let to_top = to.split('/').next().unwrap();
            edges += 1;
            if rank[to_top] > rank[top.as_str()] {
                up.push(format!("{from} -> {to}"));
            }
        }
    }
    up.sort();
    up.dedup();
    assert!(edges > 300, "the scan found {edges} imports: it reads nothing");
    assert!(up.is_empty(), "imports pointing up the data path (a lower layer using a higher one):\n{up:#?}");
}
