// The hand-written gateway-client.d.ts must describe gateway-client.js: compiled by
// `tsc -p tests/js` (npm run typecheck), this file fails when they drift apart.
//
// `Code` is the module as TypeScript infers it from the JavaScript and its JSDoc (what
// `tsc --declaration` would print for it), `Decl` the module the .d.ts declares. Every value
// export must exist on both sides with mutually assignable types; a function's or a public
// method's parameter list (its arity and optional parameters too) and its result are compared
// both ways, and so are each class's constructor parameters and public instance members
// (members whose names start with `_` are internal and skipped).

import * as Code from "#gateway-client-code";
import * as Decl from "../../gateway/static/gateway-client.js";

/** A value export or member as compared: a class, a function, or a plain value. */
type CodeMember<T> =
  T extends abstract new (...args: infer P) => infer I
    ? { constructorArgs: P; instance: CodeShape<I> }
    : T extends (...args: infer P) => infer R
      ? { args: P; returns: R }
      : T;

/** The public members of T, each as a CodeMember. */
type CodeShape<T> = { [K in keyof T as K extends `_${string}` ? never : K]: CodeMember<T[K]> };

// The same two definitions again, under other names, for the declared side: TypeScript
// relates two instantiations of one generic alias (Shape<A> to Shape<B>) by comparing A to B
// with the alias's variance, and would then compare methods loosely (an optional parameter
// made required, or one added, would pass). Distinct aliases make it compare structurally.
type DeclMember<T> =
  T extends abstract new (...args: infer P) => infer I
    ? { constructorArgs: P; instance: DeclShape<I> }
    : T extends (...args: infer P) => infer R
      ? { args: P; returns: R }
      : T;
type DeclShape<T> = { [K in keyof T as K extends `_${string}` ? never : K]: DeclMember<T[K]> };

type CodeModule = CodeShape<typeof Code>;
type DeclModule = DeclShape<typeof Decl>;

/** Fails to compile unless K is never; on failure the error names the keys. */
function noKeys<K extends never>(..._keys: K[]): void {}

// Exports and members present on one side only (the assignments below catch them too; these
// name them plainly).
noKeys<Exclude<keyof CodeModule, keyof DeclModule>>();
noKeys<Exclude<keyof DeclModule, keyof CodeModule>>();
noKeys<Exclude<keyof CodeModule["GatewayClient"]["instance"],
  keyof DeclModule["GatewayClient"]["instance"]>>();
noKeys<Exclude<keyof DeclModule["GatewayClient"]["instance"],
  keyof CodeModule["GatewayClient"]["instance"]>>();
noKeys<Exclude<keyof CodeModule["GatewayError"]["instance"],
  keyof DeclModule["GatewayError"]["instance"]>>();
noKeys<Exclude<keyof DeclModule["GatewayError"]["instance"],
  keyof CodeModule["GatewayError"]["instance"]>>();

// Every export, both ways: an error here names the path to what differs, e.g.
// "Types of property 'GatewayClient' ... 'instance' ... 'subscribe' ... 'returns'".
declare const code: CodeModule;
declare const decl: DeclModule;
export const codeAsDeclared: DeclModule = code;
export const declaredAsCode: CodeModule = decl;
