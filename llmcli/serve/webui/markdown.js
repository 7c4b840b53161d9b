// Markdown -> elements, for llmcli's chat page: every piece of model text becomes a text node or an element's
// textContent, never HTML (no innerHTML anywhere); links only to http(s) and mailto. An answer still streaming may
// end inside a code fence, a list or a table: each renders as far as it goes. `markdown(text)` is a DocumentFragment.
"use strict";

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^\s{0,3}(#{1,6})(?:\s+(.*?))?\s*#*\s*$/; // ("##" alone: an empty heading)
const SETEXT = /^\s{0,3}(=+|-+)\s*$/; // under a paragraph's line: the line is a heading (= level 1, - level 2)
const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^\s{0,3}>\s?(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;

function markdown(text) {
  const fragment = document.createDocumentFragment();
  blocks(text.split("\n"), fragment);
  return fragment;
}

function blocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i++;
    } else if ((m = FENCE.exec(line))) {
      const code = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(m[1])) code.push(lines[i++]);
      i++; // the closing fence (an open one runs to the end while it streams)
      const pre = el("pre");
      const element = el("code", m[2] ? "language-" + m[2] : "", code.join("\n"));
      pre.append(element);
      parent.append(pre);
    } else if ((m = HEADING.exec(line))) {
      const heading = el("h" + m[1].length);
      inline(m[2] || "", heading);
      parent.append(heading);
      i++;
    } else if (i + 1 < lines.length && (m = SETEXT.exec(lines[i + 1])) && !startsBlock(line)
               && !(line.includes("|") && TABLE_RULE.test(lines[i + 1]))) {
      const heading = el(m[1][0] === "=" ? "h1" : "h2");
      inline(line.trim(), heading);
      parent.append(heading);
      i += 2;
    } else if (RULE.test(line)) {
      parent.append(el("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const quoted = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) { quoted.push(m[1]); i++; }
      const quote = el("blockquote");
      blocks(quoted, quote);
      parent.append(quote);
    } else if ((m = ITEM.exec(line))) {
      i = list(lines, i, m, parent);
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
      i = table(lines, i, parent);
    } else {
      const paragraph = [];
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i])
             && !(paragraph.length && i + 1 < lines.length && SETEXT.test(lines[i + 1]))) paragraph.push(lines[i++]);
      if (!paragraph.length) paragraph.push(lines[i++]);
      const p = el("p");
      inline(paragraph.join("\n"), p);
      parent.append(p);
    }
  }
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

function list(lines, i, first, parent) {
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.setAttribute("start", String(parseInt(first[2], 10)));
  const indent = first[1].length;
  while (i < lines.length) {
    const m = ITEM.exec(lines[i]);
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
    const content = [m[3]];
    i++;
    // The item's own lines: indented deeper than its marker, blank lines between them kept.
    while (i < lines.length) {
      const next = lines[i];
      const depth = next.length - next.trimStart().length;
      if (next.trim() && depth <= indent) break;
      if (!next.trim() && !(i + 1 < lines.length && lines[i + 1].trim()
          && lines[i + 1].length - lines[i + 1].trimStart().length > indent)) break;
      content.push(next.slice(Math.min(depth, indent + 2)));
      i++;
    }
    const item = el("li");
    if (content.length === 1) inline(content[0], item);
    else blocks(content, item);
    node.append(item);
    while (i < lines.length && !lines[i].trim()) {
      const after = ITEM.exec(lines[i + 1] || "");
      if (!after || after[1].length !== indent) return finish();
      i++;
    }
  }
  return finish();

  function finish() {
    parent.append(node);
    return i;
  }
}

function cells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((cell) => cell.trim());
}

function table(lines, i, parent) {
  const node = el("table");
  const head = el("thead");
  const row = el("tr");
  for (const cell of cells(lines[i])) {
    const th = el("th");
    inline(cell, th);
    row.append(th);
  }
  head.append(row);
  node.append(head);
  const body = el("tbody");
  i += 2;
  while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
    const tr = el("tr");
    for (const cell of cells(lines[i++])) {
      const td = el("td");
      inline(cell, td);
      tr.append(td);
    }
    body.append(tr);
  }
  node.append(body);
  parent.append(node);
  return i;
}

const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__|\*(?=[^\s*])([\s\S]*?[^\s*])\*|(?<![\w])_(?=[^\s_])([\s\S]*?[^\s_])_(?![\w])|~~(?=\S)([\s\S]*?\S)~~|\[([^\]\n]+)\]\(([^)\s]+)\)|\n/g;

function inline(text, parent) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
    last = m.index + m[0].length;
    if (m[1] !== undefined) {
      parent.append(el("code", "", m[2]));
    } else if (m[3] !== undefined || m[4] !== undefined) {
      inline(m[3] ?? m[4], parent.appendChild(el("strong")));
    } else if (m[5] !== undefined || m[6] !== undefined) {
      inline(m[5] ?? m[6], parent.appendChild(el("em")));
    } else if (m[7] !== undefined) {
      inline(m[7], parent.appendChild(el("del")));
    } else if (m[8] !== undefined) {
      link(m[8], m[9], parent, m[0]);
    } else {
      parent.append(el("br"));
    }
  }
  if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
}

function link(label, target, parent, written) {
  let url = null;
  try {
    url = new URL(target, location.href);
  } catch {
    url = null;
  }
  if (!url || !["http:", "https:", "mailto:"].includes(url.protocol)) {
    parent.append(document.createTextNode(written)); // javascript:, data: and the like stay text
    return;
  }
  const a = el("a");
  a.href = url.href;
  a.rel = "noopener noreferrer nofollow";
  a.target = "_blank";
  inline(label, a);
  parent.append(a);
}
